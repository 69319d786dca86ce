"""Environment record, final results.json, snapshot tarball and the truncated log for validate.sh.

    python3 collect.py env     --work DIR --lib LIB --cli CLI          -> DIR/env.json
    python3 collect.py results --work DIR --out OUT --cases "a b ..."  -> OUT/results.json, OUT/snapshots.tar.gz
    python3 collect.py log     --src FULL_LOG --dst OUT/log.txt        -> truncated copy

`results` exits 1 when any case (or the overhead bench) failed, 0 otherwise.
"""
import argparse
import glob
import hashlib
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20
TAR_LIMIT = 14 * MIB  # compressed; files back from the machine are capped at 16 MiB each
LOG_LIMIT = 12 * MIB


def sh(cmd, timeout=60):
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout, shell=isinstance(cmd, str))
        return {"rc": p.returncode, "out": (p.stdout + p.stderr).decode("utf-8", "replace").strip()[-4000:]}
    except Exception as e:  # noqa: BLE001
        return {"rc": None, "out": repr(e)}


def py_versions():
    code = r"""
import json, sys
out = {"python": sys.version}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["torch_device_count"] = torch.cuda.device_count()
    out["torch_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as e:
    out["torch"] = "unavailable: %r" % (e,)
for mod in ("jax", "jaxlib", "cupy", "numpy"):
    try:
        m = __import__(mod)
        out[mod] = getattr(m, "__version__", "?")
    except Exception as e:
        out[mod] = "unavailable: %r" % (e,)
print(json.dumps(out))
"""
    r = sh([sys.executable, "-c", code], timeout=120)
    try:
        return json.loads(r["out"].splitlines()[-1])
    except Exception:  # noqa: BLE001
        return {"error": r["out"][-2000:]}


def file_info(path):
    if not path or not os.path.exists(path):
        return {"path": path, "exists": False}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    st = os.stat(path)
    return {"path": path, "exists": True, "bytes": st.st_size, "sha256": h.hexdigest(),
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime))}


def cmd_env(a):
    env = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "nvidia_smi": sh(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.used",
                          "--format=csv,noheader"]),
        "nvidia_smi_cuda": sh("nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | head -1"),
        "nvcc": sh(["nvcc", "--version"]),
        "gcc": sh("gcc --version | head -1"),
        "glibc": sh("ldd --version | head -1"),
        "git_commit": sh(["git", "rev-parse", "HEAD"]),
        "git_status": sh("git status --short | head -20"),
        "versions": py_versions(),
        "libmemsnap": file_info(a.lib),
        "memsnap_cli": file_info(a.cli),
        "memsnap_cli_version": sh([a.cli, "--version"]) if a.cli and os.path.exists(a.cli) else None,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("MEMSNAP_", "NCCL_", "CUDA_", "PYTORCH_", "XLA_", "TORCH_", "NVSHMEM_"))},
    }
    gpus = [ln for ln in env["nvidia_smi"]["out"].splitlines() if ln.strip() and env["nvidia_smi"]["rc"] == 0]
    env["gpu_count"] = len(gpus)
    with open(os.path.join(a.work, "env.json"), "w") as f:
        json.dump(env, f, indent=1)
    print(json.dumps({k: env[k] for k in ("nvidia_smi", "gpu_count", "versions")}, indent=1)[:3000])
    print(f"NGPU={env['gpu_count']}")
    return 0


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception:  # noqa: BLE001
        return default


def tar_snapshots(work, out_path):
    """Adds small JSON records first, then snapshots (dump files before exit files, small before
    large) until the compressed size nears TAR_LIMIT."""
    cands = []
    for p in glob.glob(os.path.join(work, "*", "*.json")):
        cands.append((0, os.path.getsize(p), p))
    for p in glob.glob(os.path.join(work, "*", "snaps", "*.pickle")):
        base = os.path.basename(p)
        prio = 1 if ("-signal-" in base or "-oom-" in base) else 2
        cands.append((prio, os.path.getsize(p), p))
    cands.sort()
    added, skipped = [], []
    raw = open(out_path, "wb")
    try:
        with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=6) as tar:
            for prio, size, p in cands:
                # estimate: pickles compress about 3x; never add a file that alone could overflow
                if raw.tell() + size // 3 > TAR_LIMIT or size > 3 * TAR_LIMIT:
                    skipped.append({"file": os.path.relpath(p, work), "bytes": size})
                    continue
                tar.add(p, arcname=os.path.relpath(p, work))
                added.append({"file": os.path.relpath(p, work), "bytes": size})
    finally:
        raw.close()
    if os.path.getsize(out_path) > 15 * MIB:  # should not happen; keep the limit anyway
        with tarfile.open(out_path, "w:gz") as tar:
            data = json.dumps({"note": "tarball over limit, emptied", "files": added}).encode()
            ti = tarfile.TarInfo("TOO_LARGE.json")
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
        skipped += added
        added = []
    return {"file": os.path.basename(out_path), "bytes": os.path.getsize(out_path), "added": added,
            "skipped": skipped}


def cmd_results(a):
    os.makedirs(a.out, exist_ok=True)
    cases = []
    for name in a.cases.split():
        d = os.path.join(a.work, name)
        res = read_json(os.path.join(d, "result.json"))
        rc_txt = open(os.path.join(d, "rc.txt")).read().strip() if os.path.exists(os.path.join(d, "rc.txt")) else "?"
        if res is None:
            why = "timed out (killed by timeout)" if rc_txt in ("124", "137") else f"exit status {rc_txt}"
            if os.path.exists(os.path.join(d, "not_run.txt")):
                why = open(os.path.join(d, "not_run.txt")).read().strip()
            res = {"name": name, "ok": False, "status": "fail", "checks": [], "measured": {}, "details": {},
                   "error": f"no result record: {why}"}
        res["exit_status"] = rc_txt
        cases.append(res)
    bench = read_json(os.path.join(a.work, "bench.json"))
    if bench is None and a.bench:
        bench = {"ok": False, "error": "bench produced no result (timeout or crash; see log.txt)"}
    results = {
        "schema": 1,
        "tool": "scripts/gpu/validate.sh",
        "started_utc": a.started,
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": read_json(os.path.join(a.work, "env.json"), {}),
        "cases": cases,
        "overhead": bench if a.bench else {"skipped": "BENCH=0"},
    }
    failed = [c["name"] for c in cases if not c.get("ok")]
    if a.bench and not (bench or {}).get("ok"):
        failed.append("overhead")
    results["summary"] = {
        "passed": [c["name"] for c in cases if c.get("status") == "pass"],
        "skipped": [c["name"] for c in cases if c.get("status") == "skip"],
        "failed": failed,
        "warnings": {c["name"]: c.get("warnings") for c in cases if c.get("warnings")},
    }
    results["ok"] = not failed
    try:
        results["tarball"] = tar_snapshots(a.work, os.path.join(a.out, "snapshots.tar.gz"))
    except Exception as e:  # noqa: BLE001
        results["tarball"] = {"error": repr(e)}
    tmp = os.path.join(a.out, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, os.path.join(a.out, "results.json"))
    if os.path.getsize(os.path.join(a.out, "results.json")) > 15 * MIB:
        for c in cases:  # keep it under the limit: drop the bulky details
            c["details"] = {"dropped": "results.json was too large"}
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    print("=" * 72)
    for c in cases:
        extra = f" failed: {c.get('failed')}" if c.get("failed") else ""
        extra += f" warnings: {c.get('warnings')}" if c.get("warnings") else ""
        extra += f" error: {str(c.get('error'))[:200]}" if c.get("error") else ""
        print(f"{c.get('status', '?').upper():5} {c['name']}{extra}")
    if a.bench and bench:
        for t in bench.get("timing", []):
            print(f"  bench {t['name']:32} median {t.get('median_ms')} ms  overhead {t.get('overhead_pct')}%")
        for t in bench.get("dump", []):
            print(f"  bench {t['name']:32} dump {t.get('dump_s')} s  {t.get('dump_bytes')} B  {t.get('entries')} entries")
        print(f"  targets: {bench.get('targets')}")
    print(f"RESULT: {'OK' if results['ok'] else 'FAILED: ' + ', '.join(failed)}")
    return 0 if results["ok"] else 1


def cmd_log(a):
    try:
        size = os.path.getsize(a.src)
    except OSError:
        open(a.dst, "w").write("(no log)\n")
        return 0
    with open(a.src, "rb") as f, open(a.dst, "wb") as g:
        if size <= LOG_LIMIT:
            g.write(f.read())
        else:
            head = LOG_LIMIT // 3
            g.write(f.read(head))
            g.write(f"\n\n[... {size - LOG_LIMIT} bytes cut ...]\n\n".encode())
            f.seek(size - (LOG_LIMIT - head))
            g.write(f.read())
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["env", "results", "log"])
    ap.add_argument("--work")
    ap.add_argument("--out")
    ap.add_argument("--lib", default="")
    ap.add_argument("--cli", default="")
    ap.add_argument("--cases", default="")
    ap.add_argument("--bench", type=int, default=1)
    ap.add_argument("--started", default="")
    ap.add_argument("--src")
    ap.add_argument("--dst")
    a = ap.parse_args()
    return {"env": cmd_env, "results": cmd_results, "log": cmd_log}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
