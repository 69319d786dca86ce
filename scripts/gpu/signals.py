"""memsnap's borrowed signals on a real GPU: a Lightning fit whose SLURM handler takes SIGUSR1,
a PyTorch job that aborts, one killed with SIGTERM, `memsnap dump` of one that registered
faulthandler on SIGUSR1 (asked through the live socket: no signal), a job compiled with
torch.compile(mode="reduce-overhead") and cold compile caches sent SIGUSR1 twice (it must live
on), and Ctrl-C on a PyTorch job. Each case runs scripts/gpu/signal_child.py; the abort,
SIGTERM and Ctrl-C cases also run without memsnap to compare how the job ended.

    python3 scripts/gpu/signals.py --lib target/release/libmemsnap.so --cli target/release/memsnap --out OUT \
        [--sigaction-log sigaction_log.so] [--only CASE,...]

--sigaction-log: scripts/gpu/sigaction_log.c built as a library, preloaded before memsnap in the
torch.compile case, so that its detail names every library that set SIGUSR1 and how.

Writes OUT/signals.json and prints one line per case; exits 1 if any case failed.
"""

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "signal_child.py")


def results(stdout):
    out = {}
    for line in stdout.splitlines():
        if line.startswith("result ") and "=" in line:
            k, v = line[7:].split("=", 1)
            out[k] = v
    return out


def env_for(folder, lib, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSNAP_") and k != "LD_PRELOAD"}
    env["MEMSNAP_FOLDER"] = folder
    env["PYTHONUNBUFFERED"] = "1"
    if lib:
        env["LD_PRELOAD"] = lib
    env.update(extra or {})
    return env


def snaps(folder, reason):
    return sorted(
        os.path.join(folder, n) for n in os.listdir(folder) if f"-{reason}-" in n and n.endswith(".pickle")
    )


def frames_of_last_entry(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    last = snap["device_traces"][0][-1]
    return snap, last


def case_lightning(lib):
    folder = tempfile.mkdtemp(prefix="memsnap-sig-")
    slurm = {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "memsnap-check",
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4242",
    }
    p = subprocess.run(
        [sys.executable, CHILD, "lightning"], env=env_for(folder, lib, slurm),
        capture_output=True, text=True, timeout=240,
    )
    r = results(p.stdout)
    files = snaps(folder, "signal")
    lines = []
    if files:
        with open(files[0], "rb") as f:
            snap = pickle.load(f)
        for seg in snap["segments"]:
            for b in seg["blocks"]:
                for fr in b.get("frames", []):
                    if fr["filename"].endswith("signal_child.py"):
                        lines.append(fr["line"])
    checks = {
        "exit 0": p.returncode == 0,
        "Lightning's handler installed": r.get("handler_type") not in (None, "Handlers", "int", "NoneType"),
        "memsnap wrote the signal snapshot": r.get("signal_file") == "1" and bool(files),
        "Lightning's handler ran (hpc checkpoint saved)": r.get("lightning_handler_ran") == "1",
        "snapshot names lines of the training script": bool(lines),
    }
    return checks, {"results": r, "files": [os.path.basename(f) for f in files], "stderr_tail": p.stderr[-1500:]}


def case_abort(lib):
    folder = tempfile.mkdtemp(prefix="memsnap-sig-")
    plain = subprocess.run([sys.executable, CHILD, "abort"], env=env_for(folder, None), capture_output=True, text=True, timeout=120)
    folder = tempfile.mkdtemp(prefix="memsnap-sig-")
    t0 = time.time()
    p = subprocess.run([sys.executable, CHILD, "abort"], env=env_for(folder, lib), capture_output=True, text=True, timeout=120)
    elapsed = time.time() - t0
    files = snaps(folder, "crash")
    checks = {"same ending as without memsnap": p.returncode == plain.returncode == -6, "crash snapshot": len(files) == 1}
    detail = {"returncode": p.returncode, "plain_returncode": plain.returncode, "seconds": round(elapsed, 2)}
    if files:
        snap, last = frames_of_last_entry(files[0])
        names = [f"{fr['filename'].rsplit('/', 1)[-1]}:{fr['line']}:{fr['name']}" for fr in last["frames"]]
        checks["signal in metadata"] = snap["memsnap"]["signal"]["name"] == "SIGABRT"
        checks["last entry is the signal with the script's line"] = last["action"] == "snapshot" and any(
            "signal_child.py" in n for n in names
        )
        checks["held memory recorded"] = sum(s["allocated_size"] for s in snap["segments"]) >= 15 << 20
        detail["frames"] = names[:12]
    return checks, detail


def case_term(lib):
    outcomes = {}
    for label, preload in (("plain", None), ("memsnap", lib)):
        folder = tempfile.mkdtemp(prefix="memsnap-sig-")
        p = subprocess.Popen([sys.executable, CHILD, "term"], env=env_for(folder, preload), stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        p.terminate()
        rc = p.wait(timeout=60)
        outcomes[label] = (rc, folder, line.strip())
    files = snaps(outcomes["memsnap"][1], "term")
    checks = {
        "same ending as without memsnap": outcomes["memsnap"][0] == outcomes["plain"][0] == -15,
        "term snapshot": len(files) == 1,
    }
    if files:
        with open(files[0], "rb") as f:
            snap = pickle.load(f)
        checks["held memory recorded"] = sum(s["allocated_size"] for s in snap["segments"]) >= 15 << 20
    return checks, {"returncodes": {k: v[0] for k, v in outcomes.items()}}


def case_dump_faulthandler(lib, cli):
    folder = tempfile.mkdtemp(prefix="memsnap-sig-")
    p = subprocess.Popen([sys.executable, CHILD, "faulthandler"], env=env_for(folder, lib), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    d = subprocess.run([cli, "dump", str(p.pid)], capture_output=True, text=True, timeout=120)
    p.stdin.close()
    rc = p.wait(timeout=60)
    with open(os.path.join(folder, "traceback.txt")) as f:
        tb = f.read()
    path = d.stdout.strip()
    # `memsnap dump` asks through the process's live socket (docs/LIVE.md): no signal
    # interrupts the job, so faulthandler, registered on the dump signal, stays silent.
    checks = {
        "dump printed the file": d.returncode == 0 and os.path.isfile(path),
        "asked through the socket, no signal (faulthandler silent)": "signal_child.py" not in tb,
        "job exited 0": rc == 0,
    }
    return checks, {"dump_stdout": path, "dump_stderr": d.stderr.strip()}


def case_compile_cold_sigusr1(lib, shim):
    """A job compiled with torch.compile(mode="reduce-overhead") and cold compile caches, then
    two SIGUSR1: it must live on and finish. With `shim` (scripts/gpu/sigaction_log.c, built
    by validate.sh) preloaded first, stderr names every library that set SIGUSR1."""
    folder = tempfile.mkdtemp(prefix="memsnap-sig-")
    caches = tempfile.mkdtemp(prefix="memsnap-cold-cache-")
    cold = {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
    }
    env = env_for(folder, lib, cold)
    if shim:
        env["LD_PRELOAD"] = f"{shim}:{lib}"
    t0 = time.time()
    p = subprocess.Popen(
        [sys.executable, CHILD, "compile"], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("result ready="):
            break
    compiled_s = time.time() - t0
    for _ in range(2):
        p.send_signal(signal.SIGUSR1)
        for _ in range(1000):
            if snaps(folder, "signal"):
                break
            time.sleep(0.01)
        time.sleep(0.2)
    out, err = p.communicate(input="", timeout=300)
    r = results("".join(lines) + out)
    usr1_lines = [l for l in err.splitlines() if l.startswith("sigaction_log:")]
    checks = {
        "exit 0 (the dump signal did not end it)": p.returncode == 0,
        "finished its steps after the signals": r.get("survived") == "1",
        "signal snapshot written": bool(snaps(folder, "signal")),
    }
    detail = {
        "returncode": p.returncode,
        "compile_seconds": round(compiled_s, 1),
        "caught_before_compile": r.get("caught_before_compile"),
        "caught_after_compile": r.get("caught_after_compile"),
        "python_sees_usr1_as": r.get("python_sees_usr1_as"),
        "sigusr1_set_by": usr1_lines[:20],
        "signal_files": len(snaps(folder, "signal")),
        "stderr_tail": err[-1500:],
    }
    return checks, detail


def case_ctrl_c(lib):
    outcomes = {}
    for label, preload in (("plain", None), ("memsnap", lib)):
        folder = tempfile.mkdtemp(prefix="memsnap-sig-")
        p = subprocess.run([sys.executable, CHILD, "ctrl-c"], env=env_for(folder, preload), capture_output=True, text=True, timeout=120)
        outcomes[label] = (p.returncode, folder, p.stderr)
    files = snaps(outcomes["memsnap"][1], "term")
    checks = {
        "same ending as without memsnap (SIGINT)": outcomes["memsnap"][0] == outcomes["plain"][0] == -2,
        "KeyboardInterrupt shown": "KeyboardInterrupt" in outcomes["memsnap"][2],
        "term snapshot": len(files) == 1,
    }
    if files:
        with open(files[0], "rb") as f:
            snap = pickle.load(f)
        checks["signal in metadata"] = snap["memsnap"]["signal"]["name"] == "SIGINT"
    return checks, {"returncodes": {k: v[0] for k, v in outcomes.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sigaction-log", help="scripts/gpu/sigaction_log.c built as a library")
    ap.add_argument("--only", help="comma-separated case names to run")
    a = ap.parse_args()
    lib, cli = os.path.abspath(a.lib), os.path.abspath(a.cli)
    shim = os.path.abspath(a.sigaction_log) if a.sigaction_log else None
    cases = {
        "compile_cold_sigusr1": lambda: case_compile_cold_sigusr1(lib, shim),
        "torch_ctrl_c": lambda: case_ctrl_c(lib),
        "lightning_slurm_sigusr1": lambda: case_lightning(lib),
        "torch_abort": lambda: case_abort(lib),
        "torch_sigterm": lambda: case_term(lib),
        "dump_with_faulthandler": lambda: case_dump_faulthandler(lib, cli),
    }
    report, ok_all = {}, True
    only = set(a.only.split(",")) if a.only else None
    for name, run in cases.items():
        if only and name not in only:
            continue
        try:
            checks, detail = run()
        except Exception as e:  # a case that breaks is a failed case, not a crash of the script
            checks, detail = {"ran": False}, {"error": repr(e)}
        ok = all(checks.values())
        ok_all &= ok
        report[name] = {"ok": ok, "checks": checks, "detail": detail}
        print(f"{'PASS' if ok else 'FAIL'} {name}: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in checks.items()), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "signals.json"), "w") as f:
        json.dump(report, f, indent=1)
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
