"""Install, on an offline machine, the batches `scripts/carry_offline.sh` staged, each as it arrives.

    python3 scripts/offline_stage.py arrive .carry/b3 --into /tmp/stack    # keep the batch; install what is whole
    python3 scripts/offline_stage.py finish --into /tmp/stack && source /tmp/stack/env.sh   # once all have arrived

Every batch holds MANIFEST.json: each file of the stack (wheels, the Java runtime) with its SHA-256 and the names of
its parts in order (a file larger than a batch, or at a batch's end, is cut into parts). `arrive` copies the batch's
parts to DIR/parts (a carried folder is gone at the next call) and starts, in a process session of its own that
outlives the call, the installation of every file whose parts have all arrived: the parts joined and checked, a
wheel unpacked into DIR/site as `pip install --target` lays it out (its console scripts written to DIR/bin), the
Java runtime unpacked into DIR/jre. So the large files install while the later batches travel. Installations take
DIR/install.lock in turn and write what they did to DIR/install.log. `finish` installs what is left, fails naming
every file that is incomplete or whose checksum differs, and writes DIR/env.sh (PYTHONPATH, PATH,
VLLM_USE_FLASHINFER_SAMPLER=0: flashinfer is not among the wheels).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

MANIFEST = "MANIFEST.json"


def arrive(batch: Path, into: Path, background: bool = True) -> None:
    """Keep `batch`'s parts under `into`/parts and install every file now whole (in a detached process unless
    `background` is False)."""
    manifest = json.loads((batch / MANIFEST).read_text())
    parts = into / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    (into / MANIFEST).write_text(json.dumps(manifest))
    names = [path.name for path in sorted(batch.iterdir()) if path.name != MANIFEST]
    for name in names:
        shutil.copyfile(batch / name, parts / (name + ".tmp"))
        (parts / (name + ".tmp")).rename(parts / name)  # a part is there whole or not at all
    print(f"{batch.name}: {len(names)} parts kept in {parts}", flush=True)
    if background:
        with open(into / "install.log", "a") as log:
            subprocess.Popen([sys.executable, __file__, "install", "--into", str(into)], stdout=log, stderr=log,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    else:
        install_whole(into)


def install_whole(into: Path) -> list[str]:
    """Install every file of the manifest whose parts have all arrived and that is not installed yet; the names
    of the files still incomplete."""
    manifest = json.loads((into / MANIFEST).read_text())
    with open(into / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        incomplete = []
        for name, entry in manifest["files"].items():
            done = into / "installed" / name
            if done.exists():
                continue
            pieces = [into / "parts" / part for part in entry["parts"]]
            if not all(piece.exists() for piece in pieces):
                incomplete.append(name)
                continue
            started = time.perf_counter()
            whole = join(pieces, into / "files" / name, entry["sha256"])
            if name.endswith(".whl"):
                unpack_wheel(whole, into / "site", into / "bin")
            else:
                with tarfile.open(whole) as archive:
                    archive.extractall(into, filter="tar")
            done.parent.mkdir(exist_ok=True)
            done.touch()
            whole.unlink()
            print(f"installed {name} in {time.perf_counter() - started:.1f} s", flush=True)
        return incomplete


def join(pieces: list[Path], whole: Path, sha256: str) -> Path:
    """`pieces` joined into `whole`, which must have the checksum `sha256`; the pieces are removed."""
    whole.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with whole.open("wb") as out:
        for piece in pieces:
            data = piece.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != sha256:
        whole.unlink()
        raise ValueError(f"{whole.name}: its parts {[p.name for p in pieces]} join to SHA-256 {digest.hexdigest()}, "
                         f"the manifest says {sha256}: a part was damaged in transit; carry its batch again")
    for piece in pieces:
        piece.unlink()
    return whole


def unpack_wheel(wheel: Path, site: Path, bin_dir: Path) -> None:
    """Lay `wheel` out as `pip install --target site` does: its files in `site`, its .data folder's purelib,
    platlib and data in `site`, its scripts and console scripts in `bin_dir`."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        names = archive.namelist()
    for data in {name.split("/")[0] for name in names if name.split("/")[0].endswith(".data")}:
        for kind in sorted((site / data).iterdir()):
            target = bin_dir if kind.name == "scripts" else site
            target.mkdir(parents=True, exist_ok=True)
            shutil.copytree(kind, target, dirs_exist_ok=True)
        shutil.rmtree(site / data)
    info = next((name.split("/")[0] for name in names if name.endswith(".dist-info/entry_points.txt")), None)
    if info is not None:
        write_console_scripts((site / info / "entry_points.txt").read_text(), bin_dir)


def write_console_scripts(entry_points: str, bin_dir: Path) -> None:
    """A script in `bin_dir` for each `name = module:function` of the [console_scripts] section."""
    section = None
    for line in entry_points.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[console_scripts]" and "=" in line:
            name, target = (part.strip() for part in line.split("=", 1))
            module, function = target.split(":")
            bin_dir.mkdir(parents=True, exist_ok=True)
            script = bin_dir / name
            script.write_text(f"#!/usr/bin/env python3\nimport sys\nfrom {module} import {function.split('.')[0]}\n"
                              f"sys.exit({function}())\n")
            script.chmod(0o755)


def finish(into: Path) -> None:
    """Install what is left; fail naming what never became whole; write `into`/env.sh."""
    incomplete = install_whole(into)
    if incomplete:
        manifest = json.loads((into / MANIFEST).read_text())
        missing = {name: [p for p in manifest["files"][name]["parts"] if not (into / "parts" / p).exists()]
                   for name in incomplete}
        raise SystemExit(f"not every batch has arrived: parts missing {missing}")
    java = sorted(into.glob("*/bin/java"))
    paths = [str(into / "bin"), *(str(path.parent) for path in java)]
    (into / "env.sh").write_text(
        f"export PYTHONPATH={into / 'site'}:$PWD${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"export PATH={':'.join(paths)}:$PATH\n"
        "export VLLM_USE_FLASHINFER_SAMPLER=0\n"
    )
    installed = len(list((into / "installed").iterdir()))
    print(f"{installed} files installed into {into}{' with a Java runtime' if java else ''}; now: source {into}/env.sh")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("arrive", "install", "finish"))
    parser.add_argument("batch", nargs="?", type=Path, help="arrive: the carried batch folder")
    parser.add_argument("--into", type=Path, required=True, help="where the stack is installed")
    parser.add_argument("--foreground", action="store_true", help="arrive: install in this process")
    args = parser.parse_args(argv)
    if args.step == "arrive":
        if args.batch is None or not (args.batch / MANIFEST).is_file():
            parser.error(f"arrive takes a batch folder holding {MANIFEST}, got {args.batch}")
        arrive(args.batch, args.into, background=not args.foreground)
    elif args.step == "install":
        install_whole(args.into)
    else:
        finish(args.into)


if __name__ == "__main__":
    main()
