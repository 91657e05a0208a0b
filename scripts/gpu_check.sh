#!/usr/bin/env bash
# The CUDA path, checked in one call: setup, fidelity, speed and a worker, each stage under its
# own time budget (timeout), leaving logs and $OUT/summary.json (per stage: status, seconds,
# key figures; the GPU's name). A stage that fails does not stop the next ones.
#
#   scripts/gpu_check.sh [--device cuda:0|cpu] [--quick] [--stages setup,fidelity,speed,quantized,worker]
#                        [--bundle DIR] [--threads N] [--keep-logs]
#
#   1 setup     install the carried wheels (DIR/call*/wheels, pip --no-index --no-deps --target,
#               never torch), join the carried GGUF parts (DIR/call*/*.partNofM) into one file
#               and point the demo pair at it (a pairs file, SPECDEC_CONFIG_FILE), check every
#               requirement, load the pair once (converts the GGUF into the cache)
#   2 fidelity  scripts/gpu_fidelity.py: greedy = transformers generate, batched = one at a
#               time, same batch twice = identical, sampled distribution (bf16, fp16 and
#               fp32 on CUDA; fp32 on CPU)
#   3 speed     benchmarks/bench_engine.py, bench_batch.py, bench_forward.py per dtype (bf16,
#               fp16 on CUDA; fp32 on CPU), JSON figures
#   4 quantized the target's own weights as its draft: benchmarks/bench_engine.py on the int4
#               self-draft pair (tinygemm on CUDA) and, on CUDA, the fp8 one (torch._scaled_mm),
#               against generate and k = 0, per dtype
#   5 worker    `specdec-llm run` of a 20-row job on --device through the embedded broker
#               (no Redis, SQLite in a fresh data dir), then `specdec-llm report`
#
# OUT defaults to a new temporary folder; the logs end up in $OUT/logs.tar.gz (a device call
# returns at most 8 files) unless --keep-logs. Budgets (seconds) can be changed with
# GPU_CHECK_BUDGETS="setup=90,fidelity=150,speed=150,quantized=100,worker=80" (the CUDA defaults).
# Python: $PYTHON or python3.
# Preparing the bundle and the device calls: scripts/gpu_prepare.sh and the docs/operations.md "GPU check".
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SELF="$REPO/scripts/gpu_check.sh"
TOOLS="$REPO/scripts/gpu_tools.py"

if [ "${1:-}" != "--_stage" ]; then  # ---------------------------------------------- the driver
  DEVICE=cuda:0 QUICK=0 STAGES=setup,fidelity,speed,quantized,worker BUNDLE="$REPO/.gpu" THREADS="" KEEP=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --device) DEVICE="$2"; shift 2 ;;
      --quick) QUICK=1; shift ;;
      --stages) STAGES="$2"; shift 2 ;;
      --bundle) BUNDLE="$2"; shift 2 ;;
      --threads) THREADS="$2"; shift 2 ;;
      --keep-logs) KEEP=--keep-logs; shift ;;
      -h|--help) sed -n 2,25p "$0"; exit 0 ;;
      *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
  done
  OUT="${OUT:-$(mktemp -d /tmp/gpu-check-out.XXXXXX)}"
  WORK="${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu-check-work.XXXXXX)}"
  PY="${PYTHON:-python3}"
  mkdir -p "$OUT/logs" "$WORK"
  rm -f "$OUT/summary.json" "$OUT/logs.tar.gz"
  if [ "$DEVICE" = cpu ]; then
    FID_DTYPES=float32 SPEED_DTYPES=float32 WORKER_DTYPE=float32 THREADS="${THREADS:-1}"
    BUDGETS="setup=180,fidelity=300,speed=300,quantized=300,worker=240"
  else
    FID_DTYPES=bfloat16,float16,float32 SPEED_DTYPES=bfloat16,float16 WORKER_DTYPE=bfloat16
    BUDGETS="setup=90,fidelity=150,speed=150,quantized=100,worker=80"
  fi
  BUDGETS="${GPU_CHECK_BUDGETS:-$BUDGETS}"
  export REPO DEVICE QUICK BUNDLE THREADS OUT WORK PY FID_DTYPES SPEED_DTYPES WORKER_DTYPE LOGS="$OUT/logs"
  export PYTHONUNBUFFERED=1
  if [ -n "$THREADS" ]; then export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS" SPECDEC_THREADS="$THREADS"; fi
  echo "gpu check: device $DEVICE, stages $STAGES$([ "$QUICK" = 1 ] && echo ', quick'), out $OUT, work $WORK"
  "$PY" - "$OUT/summary.json" "$DEVICE" "$QUICK" <<'PY'
import json, sys, time, platform
path, device, quick = sys.argv[1:]
json.dump({"device": device, "quick": quick == "1", "host": platform.node(), "python": platform.python_version(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}}, open(path, "w"), indent=2)
PY
  for stage in ${STAGES//,/ }; do
    budget="$(echo "$BUDGETS" | tr ',' '\n' | sed -n "s/^$stage=//p")"
    budget="${budget:-120}"
    t0=$(date +%s%N)
    timeout -k 10 "$budget" bash "$SELF" --_stage "$stage" > "$LOGS/$stage.log" 2>&1
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
    "$PY" "$TOOLS" record --summary "$OUT/summary.json" --stage "$stage" --status "$status" --seconds "$secs" \
      --budget "$budget" --rc "$rc" --log "$LOGS/$stage.log" --figures "$LOGS/$stage.json"
    printf '== %-9s %-8s %6.1f s (budget %s s)\n' "$stage" "$status" "$secs" "$budget"
    [ "$status" = ok ] || tail -n 15 "$LOGS/$stage.log" | sed 's/^/   | /'
  done
  "$PY" "$TOOLS" finish --out "$OUT" $KEEP
  "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/summary.json"
  exit $?
fi

# ------------------------------------------------------------------------- one stage (a child)
STAGE="$2"
set -e
cd "$REPO"
export PYTHONPATH="$REPO"
[ -f "$WORK/env.sh" ] && . "$WORK/env.sh"
CUDA=0; [ "$DEVICE" != cpu ] && CUDA=1

json_merge() {  # json_merge OUT.json IN.json...: one object keyed by each input's stem
  "$PY" - "$@" <<'PY'
import json, sys
from pathlib import Path
out, *ins = sys.argv[1:]
merged = json.loads(Path(out).read_text()) if Path(out).exists() else {}
for p in ins:
    if Path(p).is_file():
        try:
            merged[Path(p).stem] = json.loads(Path(p).read_text())
        except json.JSONDecodeError:
            merged[Path(p).stem] = {"error": "not JSON", "text": Path(p).read_text()[-2000:]}
Path(out).write_text(json.dumps(merged, indent=2))
PY
}

stage_setup() {
  : > "$WORK/env.sh"
  echo "--- device"
  "$PY" - "$LOGS/device.json" "$DEVICE" <<'PY'
import json, platform, subprocess, sys, shutil
out, device = sys.argv[1:]
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    info.update(torch=torch.__version__, cuda_available=torch.cuda.is_available(), torch_cuda=torch.version.cuda)
    if device != "cpu":
        d = torch.device(device)
        p = torch.cuda.get_device_properties(d)
        info.update(gpu=torch.cuda.get_device_name(d), capability=".".join(map(str, torch.cuda.get_device_capability(d))),
                    gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
except Exception as e:  # reported, and the stage fails below
    info["torch_error"] = repr(e)
if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    info["nvidia_smi"] = (q.stdout or q.stderr).strip()
try:
    import transformers
    info["transformers_before_setup"] = transformers.__version__
except Exception as e:
    info["transformers_before_setup"] = repr(e)
print(json.dumps(info, indent=2))
json.dump(info, open(out, "w"), indent=2)
sys.exit(1 if "torch_error" in info or (device != "cpu" and not info.get("cuda_available")) else 0)
PY
  echo "--- wheels"
  shopt -s nullglob
  wheels=("$BUNDLE"/call*/wheels/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing ${#wheels[@]} wheels into $WORK/site (--no-deps; torch is not among them)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "${wheels[@]}"
    echo "export PYTHONPATH=$REPO:$WORK/site" >> "$WORK/env.sh"
  else
    echo "no wheels in $BUNDLE/call*/wheels: using what is installed"
  fi
  printf '{"wheels_installed": %d}\n' "${#wheels[@]}" > "$LOGS/wheels.json"
  . "$WORK/env.sh"
  echo "--- GGUF"
  "$PY" "$TOOLS" join --bundle "$BUNDLE" --work "$WORK" --json "$LOGS/gguf.json" | sed 's/^/export /' >> "$WORK/env.sh"
  . "$WORK/env.sh"
  cat "$WORK/env.sh"
  echo "--- requirements"
  local deps=0
  "$PY" "$TOOLS" check-deps --json "$LOGS/deps_full.json" || deps=1
  echo "--- load the pair once (converts the GGUF into the cache on first use)"
  SPECDEC_DEVICE="$DEVICE" "$PY" - "$LOGS/load.json" <<'PY'
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from specdec_llm.pairs import load_pair, quiet_loading
quiet_loading()
pair = load_pair("smollm2-135m")
info = {"load_s": round(time.perf_counter() - t0, 1), "target": pair.spec.target, "draft": pair.draft_info.get("kind"),
        "vocab": pair.vocab_size, "device": str(pair.target.device), "transformers": transformers.__version__,
        "torch": torch.__version__}
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"))
PY
  "$PY" - "$LOGS/deps_full.json" "$LOGS/deps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keep = ("torch", "transformers", "tokenizers", "huggingface-hub", "celery", "kombu", "sqlalchemy", "langchain-core", "gguf")
json.dump({"ok": d["ok"], "problems": d["problems"], "versions": {k: d["versions"].get(k) for k in keep}},
          open(sys.argv[2], "w"))
PY
  json_merge "$LOGS/setup.json" "$LOGS/device.json" "$LOGS/wheels.json" "$LOGS/gguf.json" "$LOGS/deps.json" "$LOGS/load.json"
  [ "$deps" = 0 ] || { echo "setup: some requirements are not satisfied (see deps in the summary)"; return 1; }
}

stage_fidelity() {
  local args=()
  if [ "$QUICK" = 1 ]; then args=(--prompts 2 --max-new-tokens 10 --batch 2 --samples 40 --sample-batch 2); fi
  "$PY" scripts/gpu_fidelity.py --device "$DEVICE" --dtypes "$FID_DTYPES" --json "$LOGS/fidelity.json" \
    ${THREADS:+--threads "$THREADS"} "${args[@]}"
}

stage_speed() {
  local engine=(--per-category 1 --max-new-tokens 48) forward=(--repeats 20) fails=0
  local batch=(--prompts 32 --single-prompts 4 --batch-sizes 1,8,32 --max-new-tokens 48)
  if [ "$QUICK" = 1 ]; then
    printf '%s\n' '{"prompt": "Name three colors.", "category": "qa"}' \
      '{"prompt": "Count from one to five.", "category": "writing"}' > "$WORK/bench_prompts.jsonl"
    engine=(--prompts "$WORK/bench_prompts.jsonl" --per-category 1 --max-new-tokens 8 --methods "engine k=0,engine default")
    batch=(--prompts-file "$WORK/bench_prompts.jsonl" --prompts 2 --single-prompts 2 --batch-sizes 1,2 --max-new-tokens 8)
    forward=(--repeats 2 --context 32)
  fi
  local threads=(); [ -n "$THREADS" ] && threads=(--threads "$THREADS")
  for dtype in ${SPEED_DTYPES//,/ }; do
    export SPECDEC_DEVICE="$DEVICE" SPECDEC_DTYPE="$dtype"
    for bench in engine batch forward; do
      echo "=== $dtype: bench_$bench (at ${SECONDS} s)"
      local out="$LOGS/bench_${bench}_$dtype.json"
      case $bench in
        engine) "$PY" benchmarks/bench_engine.py "${engine[@]}" "${threads[@]}" --json "$out" ;;
        batch) "$PY" benchmarks/bench_batch.py "${batch[@]}" "${threads[@]}" --json "$out" ;;
        forward) "$PY" benchmarks/bench_forward.py --json "${forward[@]}" "${threads[@]}" > "$WORK/forward.out" \
                   && tail -n 1 "$WORK/forward.out" | tee "$out" ;;
      esac || fails=$((fails + 1))
      json_merge "$LOGS/speed.json" "$out"  # after each run: a stage out of time keeps what it finished
    done
  done
  [ "$fails" = 0 ] || { echo "$fails benchmark runs failed"; return 1; }
}

stage_quantized() {
  local engine=(--per-category 1 --max-new-tokens 64) pairs=(smollm2-135m-q4 smollm2-135m-fp8) fails=0
  if [ "$QUICK" = 1 ]; then
    printf '%s\n' '{"prompt": "Name three colors.", "category": "qa"}' > "$WORK/quantized_prompts.jsonl"
    engine=(--prompts "$WORK/quantized_prompts.jsonl" --per-category 1 --max-new-tokens 8)
  fi
  [ "$CUDA" = 1 ] || pairs=(smollm2-135m-q4)  # fp8 has no native CPU kernel (30x an fp32 matmul)
  local threads=(); [ -n "$THREADS" ] && threads=(--threads "$THREADS")
  for dtype in ${SPEED_DTYPES//,/ }; do
    export SPECDEC_DEVICE="$DEVICE" SPECDEC_DTYPE="$dtype"
    for pair in "${pairs[@]}"; do
      echo "=== $dtype: bench_engine --pair $pair (at ${SECONDS} s)"
      local out="$LOGS/${pair#smollm2-135m-}_$dtype.json"
      "$PY" benchmarks/bench_engine.py --pair "$pair" --methods "hf generate,engine k=0,engine quantized" \
        "${engine[@]}" "${threads[@]}" --json "$out" || fails=$((fails + 1))
      json_merge "$LOGS/quantized.json" "$out"
    done
  done
  [ "$fails" = 0 ] || { echo "$fails benchmark runs failed"; return 1; }
}

stage_worker() {
  local n=64 batch=8
  [ "$QUICK" = 1 ] && n=8 batch=4
  # 20 Spec-Bench dev prompts, round-robin over the categories (--quick: the 20 shortest)
  "$PY" - "$REPO/data/spec_bench_dev.jsonl" "$WORK/rows.jsonl" "$QUICK" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8") if line.strip()]
by_cat = {}
for r in rows:
    by_cat.setdefault(r["category"], []).append(r)
picked = [r for i in range(20) for c in sorted(by_cat) if i < len(by_cat[c]) for r in [by_cat[c][i]]][:20]
if sys.argv[3] == "1":
    picked = sorted(rows, key=lambda r: len(r["turns"][0]))[:20]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for r in picked:
        f.write(json.dumps({"id": f"q{r['question_id']}", "prompt": r["turns"][0], "category": r["category"]}) + "\n")
PY
  # the embedded broker and a SQLite store in a fresh data dir: nothing to install or reach
  unset SPECDEC_BROKER_URL SPECDEC_RESULT_BACKEND SPECDEC_DATABASE_URL
  export SPECDEC_DATA_DIR="$WORK/data" SPECDEC_DTYPE="$WORKER_DTYPE"
  "$PY" -m specdec_llm run "$WORK/rows.jsonl" --pair smollm2-135m --device "$DEVICE" --chat --max-new-tokens "$n" \
    --max-batch "$batch" --name gpu-check --out "$LOGS/worker_results.jsonl"
  "$PY" -m specdec_llm report --group-by job --format json --out "$LOGS/worker_report.json"
  "$PY" -m specdec_llm report --group-by drafter --format json --out "$LOGS/worker_drafters.json"
  cp "$WORK"/data/logs/*.log "$LOGS/" 2>/dev/null || true
  "$PY" - "$LOGS" "$DEVICE" "$WORKER_DTYPE" <<'PY'
import json, sys
from pathlib import Path
logs, device, dtype = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
results = [json.loads(line) for line in (logs / "worker_results.jsonl").read_text().splitlines() if line.strip()]
report = json.loads((logs / "worker_report.json").read_text())
drafters = json.loads((logs / "worker_drafters.json").read_text())
worker_logs = "".join(p.read_text(errors="replace") for p in logs.glob("worker-*.log"))
on_device = f"on {device}," in worker_logs
ok_rows = sum(r["status"] == "ok" for r in results)
figures = {"rows": len(results), "ok_rows": ok_rows, "dtype": dtype, "worker_on_device": on_device,
           "report": report, "by_drafter": drafters}
(logs / "worker.json").write_text(json.dumps(figures, indent=2))
print(json.dumps({k: v for k, v in figures.items() if k not in ("report", "by_drafter")}))
problems = [m for m, bad in ((f"{len(results)} rows, not 20", len(results) != 20), (f"{ok_rows} ok rows of 20", ok_rows != 20),
                             ("the report is empty", not report), (f"no worker log line 'on {device},'", not on_device)) if bad]
sys.exit("worker stage: " + "; ".join(problems) if problems else 0)
PY
}

# -- growing the corpus and training an EAGLE draft (scripts/gpu_distill.sh runs these two) --
pack_result() {  # what the device call brings back: new corpus shards and the draft, one archive
  tar -czf "$OUT/distill.tar.gz" -C "$WORK/result" .
}

stage_corpus() {
  local hours="${GPU_CORPUS_HOURS:-0.055}" args=(--batch 384 --samples 7 --dtype bfloat16 --max-new-tokens 256)
  if [ "$DEVICE" = cpu ]; then args=(--batch 8 --samples 0 --dtype float32 --max-new-tokens 64); fi
  if [ "$QUICK" = 1 ]; then args=(--batch 2 --samples 1 --dtype float32 --max-new-tokens 8); hours="${GPU_CORPUS_HOURS:-0.004}"; fi
  # grow a copy of the committed corpus: the shards it adds are what comes back
  rm -rf "$WORK/corpus" "$WORK/result/corpus"
  mkdir -p "$WORK/corpus" "$WORK/result"
  [ -d "$REPO/data/corpus" ] && cp -r "$REPO/data/corpus/." "$WORK/corpus/"
  (cd "$WORK/corpus" && find . -name '*.npz' | sort) > "$WORK/corpus.before"
  SPECDEC_DEVICE="$DEVICE" "$PY" -m specdec_llm corpus grow --pair smollm2-135m --device "$DEVICE" \
    --prompts "$REPO/data/distill_prompts_smollm2-135m.jsonl" --prompts "$REPO/data/corpus_prompts_extra.jsonl" \
    --root "$WORK/corpus" --hours "$hours" "${args[@]}"
  (cd "$WORK/corpus" && find . -name '*.npz' | sort) > "$WORK/corpus.after"
  comm -13 "$WORK/corpus.before" "$WORK/corpus.after" | while read -r f; do
    mkdir -p "$WORK/result/corpus/$(dirname "$f")" && cp "$WORK/corpus/$f" "$WORK/result/corpus/$f"
  done
  "$PY" -m specdec_llm corpus show --root "$WORK/corpus"
  "$PY" - "$WORK/corpus.before" "$WORK/corpus.after" "$LOGS/corpus.json" <<'PY'
import json, sys
before, after = (set(open(p).read().split()) for p in sys.argv[1:3])
json.dump({"shards_before": len(before), "new_shards": len(after - before)}, open(sys.argv[3], "w"))
sys.exit(0 if after - before else "corpus stage: no new shard")
PY
  pack_result
}

stage_eagle() {
  local hours="${GPU_EAGLE_HOURS:-0.06}" args=(--batch-size 64 --max-len 512 --steps 4000 --lr 1e-3)
  if [ "$DEVICE" = cpu ]; then args=(--batch-size 4 --max-len 128 --steps 20 --vocab-subset 4096); fi
  if [ "$QUICK" = 1 ]; then args=(--batch-size 2 --max-len 64 --steps 3 --vocab-subset 1024); fi
  local fp corpus
  fp="$(cd "$WORK/corpus" && ls -td -- */ | head -1)"  # the target's folder the corpus stage grew
  corpus="$WORK/corpus/${fp%/}"
  # a dry run trains on the shards it just added only: teacher features for the whole corpus
  # take minutes on a CPU
  [ "$QUICK" = 1 ] && corpus="$WORK/result/corpus/${fp%/}"
  rm -rf "$WORK/result/eagle-draft"
  SPECDEC_DEVICE="$DEVICE" "$PY" -m specdec_llm distill --kind eagle --pair smollm2-135m --device "$DEVICE" \
    --corpus "$corpus" --work "$WORK/eagle" --out "$WORK/result/eagle-draft" --hours "$hours" "${args[@]}"
  "$PY" - "$WORK/result/eagle-draft/specdec_draft.json" "$LOGS/eagle.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1]))
train = meta.get("train", {})
json.dump({"steps": train.get("steps"), "tokens_seen": train.get("tokens_seen"),
           "heldout_curve": train.get("heldout_curve", [])[-5:]}, open(sys.argv[2], "w"))
PY
  pack_result
}

"stage_$STAGE"
