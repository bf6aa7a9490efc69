#!/usr/bin/env bash
# Downloads what the GPU machine lacks to run tests/python_sglang_gpu_engine_test.py
# (sglang's own HostPoolGroup / L2TransferEngine / HybridCacheController over kvhost
# pools and sglang's CUDA device pools), for its Python 3.12, and packs it into
# OUT_DIR/engine-wheels-cp312.tar.xz, which scripts/gpu_run.sh OUT sglang installs.
#   scripts/engine_wheels_gpu.sh OUT_DIR      (OUT_DIR: a git-ignored folder, e.g. enginez)
# The GPU machine has torch 2.11 (CUDA 13) with its own dependencies (numpy, triton,
# nvidia-*, cuda-bindings, sympy, networkx, jinja2, filelock, fsspec, typing_extensions)
# and no network; this carries sglang (--no-deps) and the distributions its modules
# import beyond those (NEEDED, below), at the versions python/requirements-engines.txt
# pins (read from there; a name missing there is an error), cp312 manylinux x86_64 or
# pure-Python wheels from PyPI. NEEDED was found by importing the test's sglang modules
# under Python 3.12 and PyPI's torch 2.11.0+cu130, with torch.cuda.is_available() forced
# true (sglang imports its CUDA kernels only then): every distribution imported, less
# torch's, and certifi (requests imports it; found by installing this set into such a
# venv through gpu_run.sh OUT sglang, the way the GPU machine does). Exceptions:
#   - torchvision: sglang imports it, and the pinned 0.29.2 is built for torch 2.14
#     ("operator torchvision::nms does not exist" on 2.11); KVHOST_GPU_TORCHVISION
#     (default 0.26.0, torch 2.11's) is carried instead; gpu_run.sh keeps the
#     machine's own torchvision where one imports.
#   - pip (KVHOST_GPU_PIP, default 25.0.1): gpu_run.sh installs it into the venv only
#     where python3's venv has none (e.g. a venv made by uv from a python3 without
#     ensurepip).
#   - sgl_kernel (sglang-kernel, CUDA kernels built for torch 2.14, hundreds of MB):
#     not carried; the test stands in for it (tests/sgl_kernel_standin.py).
# sglang's wheel is carried without its four Rust extension modules for the server
# (sglang/srt/rust_extensions/_server, _bench, _grpc, _multimodal: 40 MB that none of
# the test's modules loads), with its RECORD to match. Each wheel is re-zipped
# uncompressed (the same files, so its RECORD holds) and the set xz-compressed
# together: ~40 MiB instead of 84 MiB of wheels (47 MiB with those extensions).
# Takes ~5 minutes on a 2-core machine (xz -9e), most of it compressing (vLLM's part:
# see VLLM_NEEDED; docs/VLLM.md). Downloads are
# kept in $KVHOST_ENGINE_ROOT/wheels-cp312 (default /var/cache/kvhost) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/engine_wheels_gpu.sh OUT_DIR}
REQ=python/requirements-engines.txt
PY=${PYTHON:-python3}
cache=${KVHOST_ENGINE_ROOT:-/var/cache/kvhost}/wheels-cp312
# vLLM's part, OUT_DIR/vllm-wheels-cp312.tar.xz (for tests/python_vllm_gpu_test.py): a set
# of its own, without sglang, that gpu_run.sh's sglang step makes a venv from
# (KVHOST_ENGINE_WHEELS=enginez/vllm-wheels-cp312.tar.xz; docs/VLLM.md), carried instead of
# the sglang set (both would pass the 64 MiB carry): vllm (its Python files alone, below)
# and every distribution that `import vllm.distributed.kv_transfer.kv_connector.v1.
# offloading_connector`, `vllm.v1.kv_offload.cpu.spec` and kvhost.vllm import beyond
# torch's own (found as NEEDED was, in the engine venv), jiter (openai's, imported
# lazily), and torchvision and pip as below.
VLLM_NEEDED=(vllm PyYAML aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types
  anyio apache-tvm-ffi attrs cachetools cbor2 certifi charset-normalizer cloudpickle dill
  fastapi frozenlist h11 httpcore2 httpx2 huggingface_hub idna jiter llguidance msgspec
  multidict openai opentelemetry-api orjson oss-harmony packaging partial-json-parser pillow
  prometheus_client propcache psutil py-cpuinfo pybase64 pydantic pydantic_core pyzmq regex
  requests safetensors sentencepiece sniffio starlette tokenizers tqdm transformers
  truststore typing-inspection urllib3 uvloop xgrammar yarl)
NEEDED=(sglang PyYAML Pygments aiohappyeyeballs aiohttp aiosignal annotated-types anyio
  apache-tvm-ffi attrs certifi charset-normalizer compressed-tensors dill frozenlist gguf h11
  httpcore2 httpx2 huggingface_hub idna ipython loguru msgspec multidict orjson packaging
  pillow propcache psutil pybase64 pydantic pydantic_core pyzmq regex requests safetensors
  sentencepiece starlette tokenizers tqdm traitlets transformers truststore
  typing-inspection urllib3 yarl)
pin_of() {  # pin_of NAME: its line in $REQ; names compare as pip's do: case, - _ . alike
  local pin
  pin=$(grep -i -E "^${1//[-_.]/[-_.]}==" "$REQ" || true)
  if [ -z "$pin" ] || [ "$(wc -l <<<"$pin")" -ne 1 ]; then
    echo "$REQ has no single pin for $1" >&2
    return 1
  fi
  echo "$pin"
}
pins=()
for name in "${NEEDED[@]}"; do
  pins+=("$(pin_of "$name")")
done
extra_pins=("torchvision==${KVHOST_GPU_TORCHVISION:-0.26.0}"
  # The installer, used only where the machine's python3 gives the venv no pip.
  "pip==${KVHOST_GPU_PIP:-25.0.1}")
pins+=("${extra_pins[@]}")
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
  manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 \
  manylinux2010 manylinux_2_5 manylinux1 linux; do  # Ubuntu 24.04: glibc 2.39
  platforms+=(--platform "${tag}_x86_64")
done
vllm_pins=()
for name in "${VLLM_NEEDED[@]}"; do
  vllm_pins+=("$(pin_of "$name")")
done
vllm_pins+=("${extra_pins[@]}")
mkdir -p "$cache" "$out"
# vLLM's wheel (336 MB, cp38-abi3) as scripts/engine_venv.sh downloaded it, if it did.
cp -n "${KVHOST_ENGINE_ROOT:-/var/cache/kvhost}/wheels/${vllm_pins[0]/==/-}-"*.whl "$cache/" \
  2>/dev/null || true
mapfile -t all_pins < <(printf '%s\n' "${pins[@]}" "${vllm_pins[@]}" | sort -u)
"$PY" -m pip --disable-pip-version-check -q download --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$cache" "${all_pins[@]}"
stage=$(mktemp -d)
vstage=$(mktemp -d)
trap 'rm -rf "$stage" "$vstage"' EXIT
pack() {  # pack STAGE_DIR PIN...: the pins' cached wheels, re-zipped into STAGE_DIR
"$PY" - "$cache" "$@" <<'EOF'
import os, re, sys, zipfile  # noqa: E401
cache, stage, pins = sys.argv[1], sys.argv[2], sys.argv[3:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
# sglang's Rust extensions for its HTTP / gRPC server, benchmarks and multimodal
# processing: 40 MB that no module the test imports loads (checked: not in
# sys.modules after them); left out with their RECORD lines. And of vLLM's wheel,
# everything but its Python files and dist-info: its compiled ops (vllm/*.so), its
# vllm-rs binary and third-party CUDA headers (280 of its 336 MB; the GPU test
# runs vLLM's CPU offloading worker only where vllm._custom_ops loads).
DROP = re.compile(r"sglang/srt/rust_extensions/_(server|bench|grpc|multimodal)\.cpython-"
                  r"|vllm/(?!.*\.py$)")
files = os.listdir(cache)
for pin in pins:
    name, version = pin.split("==")
    found = [f for f in files if f.endswith(".whl") and norm(f.split("-")[0]) == norm(name)
             and f.split("-")[1] == version and ("cp312" in f or "py3" in f or "abi3" in f)]
    assert len(found) == 1, (pin, found)
    with zipfile.ZipFile(os.path.join(cache, found[0])) as src, \
            zipfile.ZipFile(os.path.join(stage, found[0]), "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if DROP.match(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not DROP.match(line.decode().split(",")[0]))
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
EOF
}
tarball() {  # tarball STAGE_DIR NAME: OUT_DIR/NAME.tar.xz and NAME.txt (its wheels)
  ls "$1" >"$out/$2.txt"
  tar -cf - -C "$1" . | xz -9e -T1 >"$out/$2.tar.xz.tmp"
  mv "$out/$2.tar.xz.tmp" "$out/$2.tar.xz"
  local size
  size=$(stat -c %s "$out/$2.tar.xz")
  echo "$out/$2.tar.xz: $(wc -l <"$out/$2.txt") wheels," \
    "$((size / 1048576)).$(( (size % 1048576) * 10 / 1048576 )) MiB"
}
pack "$stage" "${pins[@]}"
tarball "$stage" engine-wheels-cp312
pack "$vstage" "${vllm_pins[@]}"
tarball "$vstage" vllm-wheels-cp312
