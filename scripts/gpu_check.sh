#!/usr/bin/env bash
# The device checks of a lent GPU machine, sized for its calls (10 minutes each at most).
#
#   bash scripts/gpu_check.sh all OUT [--tiny]     # every stage below, in order of value, <= 9 minutes on a GPU
#   bash scripts/gpu_check.sh cli|suite|fit|micro|nccl|demo OUT [--tiny]   # one stage, in its own time box
#   bash scripts/gpu_check.sh compile OUT          # bench_compile.py: compile cost through the CLI (~6 min)
#   python benchmarks/gpu_suite.py --recipes paper --tasks classify --interleaved decide --interleaved-only \
#       --interleaved-budget-s 500   # one device call per task: a paper network's six channels_last x compile
#                                    # variants, for the recipe's model.compile decision (~25-45 s per compile)
#
# Stages and their time boxes on a GPU (seconds), sized from the first GPU run of these checks (an H200 with
# 16 cores, 2026-11-27: CLI processes of 20-48 s with 4 side by side, resume cells 74-119 s,
# ~23-29 s per gpu_suite run, 0.43 it/s for the demo beside other jobs):
#   setup  15  wheels from .whl (49 MB, unpacked, nothing compiled) and the machine's description, in its own
#              box (GPU_CHECK_SETUP_BOX, 60 s): its seconds are the cold start, the summary's first row; an
#              overrun fails the setup row by name instead of eating the last stage's box
#   cli   215  benchmarks/gpu_cli.py --budget-s 205: fit, resume, test, predict, export, fp16 and both compile
#              modes of the four tasks, ~41 CLI processes of ~25 s = ~1,000 process-seconds over 6 slots
#              (the resume's three fits side by side, so ~8 processes at a time on 16 cores): ~170-200 s.
#              Cheaper than the first run: 10 training steps instead of 20, resume in 2 epochs of 2 steps
#              with one restart and its three uninterrupted-or-stopped fits side by side (2 process times
#              instead of 4 in a row), loader workers only where loaders are checked, channels_last left to
#              the fit stage (the paper recipes set it). Compiled cells come last: the budget cuts them first.
#   suite 140  benchmarks/gpu_suite.py --budget-s 125 --interleaved-budget-s 90 (+ ~15 s of imports and CUDA
#              start-up): the paper recipes. First the interleaved groups (90 s): each paper network against its
#              peer, eager, 7 rounds x 5 steps between CUDA events, the order alternating (the check's headline;
#              ~8 s a variant, ~16 s a pair), then its channels_last flip against the recipe's setting (compiled
#              decision variants do not fit here: see `compile`); then single-window runs with what is left
#              (inference at the paper's protocol).
#   fit    85  benchmarks/gpu_fit.py --budget-s 80: the four paper recipes, 40 steps each, ~20 s a recipe
#              (start-up ~8 s, 10 untimed + 30 timed steps); their data are built while the cli stage runs
#   micro  20  benchmarks/gpu_groupnorm.py: MobileViTv2's GroupNorm as layer_norm vs var_mean + affine at
#              batches 4/32/128, interleaved rounds timed with CUDA events (~10 s after ~5 s of imports)
#   nccl   25  benchmarks/gpu_nccl.py --budget-s 20: what README's "A rank that dies" relies on. A one-rank
#              `python -m tasks.classify fit --trainer.strategy ddp` whose process group must be nccl with
#              COLLECTIVE_TIMEOUT (tasks/cli/sharding.py), beside two children whose all_reduce is stuck past a
#              3 s timeout behind a spinning kernel: with TORCH_NCCL_ASYNC_ERROR_HANDLING unset (torch's default)
#              the watchdog must end one, non-zero, with its timeout line; with 0 the other must keep running.
#              A check that fails, or that the budget cut (a watchdog slower than ~10 s past the timeout), fails
#              the stage; its table names it. An estimate until a GPU has run it: ~15 s (the fit's start-up;
#              the children queue at ~6 s).
#   demo   40  benchmarks/gpu_fit.py --demo 28: `python -m tasks.detect fit`, alone, 28 s of fitting after
#              ~10 s of start-up (a 65 s box and 50 s of fitting before the nccl stage); its it/s beside the
#              2-core CPU's (CPU_DEMO below)
#   total 540 s <= 540. Every stage writes its files as it goes and stops at its box, so a cut run still
#   reports what finished; a stage never runs past what is left of the 540 s.
#
# OUT holds at most 8 files, none in a folder: summary.md (the headline rows that did not run, if any; the
# machine, each stage's box and seconds, then every table), all.log (everything printed), gpu_cli.json,
# gpu_suite.json, gpu_fit.json, demo.json, gpu_groupnorm.json, failed_cells.log (the end of each failed CLI
# cell's log; only if one failed). The nccl stage's report is its table in summary.md and its JSON in all.log
# (TABLE_ONLY: a ninth file would pass the device's limit). Run folders stay in /tmp.
#
# Headline rows: each paper recipe's eager ours-vs-peer pair of the suite stage, each paper-recipe fit, the demo.
# One that did not run (skipped, cut by a budget, an error; a peer with no equivalent of the recipe aside)
# fails the check and is named at the top of summary.md.
#
# --tiny: the same stages on a CPU at toy sizes with no time boxes (tests/test_gpu_check.py), so that this
# script cannot rot; its numbers mean nothing.
#
# On a machine with PyTorch but without the suite's other requirements, first run
# `bash scripts/device_wheels.sh .whl` where PyPI is reachable and carry .whl along: this script
# installs what it finds there into /tmp/site.
set -uo pipefail
stage=${1:?all, cli, suite, fit, micro, nccl, demo or compile}
out=${2:-benchmarks/gpu_results}
tiny=""
if [[ "${3:-}" == "--tiny" ]]; then tiny="--tiny"; fi
#: the demo on this project's 2-core CPU machine: benchmarks/gpu_fit.py --demo 60 --accelerator cpu
CPU_DEMO="1.61 it/s measured on 2 cores that other jobs shared (1 torch thread left to it), 2026-11-27; ~4 it/s on 2 quiet cores (README)"
total=${GPU_CHECK_TOTAL_S:-540}
start=$SECONDS
work=${GPU_CHECK_WORK:-/tmp/gpu_check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf "$work" && mkdir -p "$work"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline NO_ALBUMENTATIONS_UPDATE=1
export SUITE_DATA_CACHE=${SUITE_DATA_CACHE:-/tmp/suite-cache}
log="$out/all.log"
summary="$out/summary.md"
: > "$log"

setup_rc=0
if compgen -G ".whl/*.whl" > /dev/null; then  # in its own box, so an overrun is named here
  timeout --signal=TERM --kill-after=5 "${GPU_CHECK_SETUP_BOX:-60}" python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$log"
  setup_rc=${PIPESTATUS[0]}
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# the tasks, as each declares itself in configs/<task>/task.yaml
mapfile -t task_list < <(python3 -c "from configs.tasks import task_names; print('\n'.join(task_names()))")

if [[ -n "$tiny" ]]; then
  accelerator=cpu; total=${GPU_CHECK_TOTAL_S:-100000}
  cli_box=100000 suite_box=100000 fit_box=100000 micro_box=100000 nccl_box=100000 demo_box=100000 demo_s=10
  cli_budget=0 suite_budget=0 fit_budget=0 nccl_budget=0
  suite_flags=(--tiny --tasks "${task_list[@]}" --recipes paper --precisions bf16-mixed)
  headline_flags=(--allow-missing-peers)  # a peer library this CPU machine lacks is no failure of the smoke run
  machine="CPU smoke run (--tiny): $(nproc) cores"
else
  accelerator=gpu
  cli_box=215 suite_box=140 fit_box=85 micro_box=20 nccl_box=25 demo_box=40 demo_s=28
  cli_budget=205 suite_budget=125 fit_budget=80 nccl_budget=20
  suite_flags=(--recipes paper --precisions bf16-mixed --channels-last recipe --compile off regional network
               --interleaved-budget-s 90)  # the interleaved pairs are the headline: ~16 s each at ~8 s a variant
  headline_flags=()
  machine="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1), $(nproc) cores"
fi
versions=$(python3 -c "import torch, lightning; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'lightning', lightning.__version__)" 2>&1)
{
  echo "# GPU check: \`bash scripts/gpu_check.sh $stage OUT $tiny\`"
  echo
  echo "- machine: $machine; $versions; $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- the headline demo on the 2-core CPU: $CPU_DEMO"
  echo
  echo "| stage | box s | ran s | exit |"
  echo "| --- | ---: | ---: | ---: |"
  echo "| setup (the cold start: wheels, imports, the machine) | $([[ -n "$tiny" ]] && echo none || echo "${GPU_CHECK_SETUP_BOX:-60}") | $(( SECONDS - start )) | $setup_rc$( (( setup_rc == 124 || setup_rc == 137 )) && echo ' (box)') |"
} > "$work/head.md"
: > "$work/headline.md"
: > "$work/stages.md"
: > "$work/tables.md"

# box SECONDS: the stage's box, cut to what is left of the total
box() {
  local left=$(( total - (SECONDS - start) ))
  if (( $1 < left )); then echo "$1"; elif (( left > 5 )); then echo "$left"; else echo 5; fi
}

# write the summary from what the stages have left so far (after every stage: a cut run keeps it)
write_summary() {
  cat "$work/headline.md" "$work/head.md" "$work/stages.md" "$work/tables.md" > "$summary"
}

# the headline rows that did not run, named at the top of the summary; fails the check if there is one
headline_check() {
  python3 benchmarks/gpu_headline.py "$out" "$work/headline.md" "$stage" "${headline_flags[@]}"
}

#: the stages whose JSON stays out of OUT: their table in the summary and their log say it all
TABLE_ONLY=" nccl "

# run_stage NAME BOX FOLDER COMMAND...: runs COMMAND (writing into FOLDER) in its box, then copies FOLDER's
# JSON into OUT (but for TABLE_ONLY stages) and its Markdown into the summary
run_stage() {
  local name=$1 box_s; box_s=$(box "$2"); local folder=$3; shift 3
  local began=$SECONDS
  echo "== $name: box $box_s s ($(( SECONDS - start )) s into the check)" | tee -a "$log"
  mkdir -p "$folder"
  timeout --signal=TERM --kill-after=10 "$box_s" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local label=$box_s; [[ -n "$tiny" ]] && label="none"
  echo "| $name | $label | $(( SECONDS - began )) | $rc$( (( rc == 124 || rc == 137 )) && echo ' (box)') |" >> "$work/stages.md"
  [[ "$TABLE_ONLY" == *" $name "* ]] || for f in "$folder"/*.json; do [[ -e "$f" ]] && cp "$f" "$out/"; done
  for f in "$folder"/*.md; do [[ -e "$f" ]] && { echo; echo "## $name: $(basename "$f")"; echo; cat "$f"; } >> "$work/tables.md"; done
  write_summary
  return "$rc"
}

failed_cells() {  # the end of each failed CLI cell's logs, one file
  python3 - "$work/cli" "$out/failed_cells.log" <<'EOF'
import json, sys
from pathlib import Path
folder, target = Path(sys.argv[1]), Path(sys.argv[2])
report = folder / "gpu_cli.json"
rows = json.loads(report.read_text())["rows"] if report.exists() else []
parts = []
for row in rows:
    if row["status"] != "failed":
        continue
    for log in sorted((folder / "work" / row["task"]).glob(f"{'resume' if row['cell'] == 'resume' else row['cell']}*.log")):
        parts.append(f"===== {row['task']} {row['cell']}: {log.name}\n{log.read_text(errors='replace')[-6000:]}")
if parts:
    target.write_text("\n\n".join(parts))
EOF
}

cli() {
  run_stage cli "$cli_box" "$work/cli" python3 benchmarks/gpu_cli.py --accelerator "$accelerator" $tiny \
    --budget-s "$cli_budget" --output "$work/cli" --work "$work/cli/work"
  local rc=$?
  failed_cells
  return $rc
}
suite() {
  run_stage suite "$suite_box" "$work/suite" python3 benchmarks/gpu_suite.py "${suite_flags[@]}" \
    --budget-s "$suite_budget" --output "$work/suite"
}
fit() {
  run_stage fit "$fit_box" "$work/fit" python3 benchmarks/gpu_fit.py --accelerator "$accelerator" $tiny \
    --budget-s "$fit_budget" --work "$work/fit/work" --output "$work/fit"
}
micro() {
  run_stage micro "$micro_box" "$work/micro" python3 benchmarks/gpu_groupnorm.py $tiny --out "$work/micro"
}
nccl() {
  run_stage nccl "$nccl_box" "$work/nccl" python3 benchmarks/gpu_nccl.py $tiny --budget-s "$nccl_budget" \
    --work "$work/nccl/work" --output "$work/nccl"
}
demo() {
  local accel=()
  [[ -n "$tiny" ]] && accel=(--accelerator cpu)
  run_stage demo "$demo_box" "$work/demo" python3 benchmarks/gpu_fit.py --demo "$demo_s" "${accel[@]}" $tiny \
    --work "$work/demo/work" --output "$work/demo"
}
build_data() {  # the fit stage's benchmark-sized data, built beside the cli stage (which times nothing)
  python3 benchmarks/gpu_fit.py --build-only --work "$work/build" > "$work/build.log" 2>&1
}

status=0
case "$stage" in
  all)
    build_data & builder=$!
    cli || status=1
    suite || status=1
    wait "$builder" || { echo "building the fit stage's data failed:"; tail -20 "$work/build.log"; } | tee -a "$log"
    fit || status=1
    micro || status=1
    nccl || status=1
    demo || status=1 ;;
  cli) cli || status=1 ;;
  suite) suite || status=1 ;;
  fit) build_data; fit || status=1 ;;
  demo) demo || status=1 ;;
  micro) micro || status=1 ;;
  nccl) nccl || status=1 ;;
  compile)
    run_stage compile 600 "$work/compile" python3 benchmarks/bench_compile.py --accelerator gpu --precision bf16-mixed \
      --max-epochs 1 --tasks "${task_list[@]}" --output "$work/compile/results_compile.md" || status=1 ;;
  *) echo "unknown stage $stage: all, cli, suite, fit, micro, nccl, demo or compile" >&2; exit 2 ;;
esac
(( setup_rc == 0 )) || status=1
headline_check | tee -a "$log"
(( PIPESTATUS[0] == 0 )) || status=1
write_summary
echo "gpu_check $stage: $(( SECONDS - start )) s, exit $status; $summary" | tee -a "$log"
exit "$status"
