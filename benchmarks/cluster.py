"""Step time on an emulated slow-network cluster: Horovod fp32/fp16 vs the packed ALQ exchange.

    python benchmarks/cluster.py                 # 2 and 4 hosts × 100 Mbit/s and 1 Gbit/s
    python benchmarks/cluster.py --quick         # CI: 2 hosts, 100 Mbit/s, small model, few steps
    python benchmarks/cluster.py --setup         # only install missing Debian packages
    python benchmarks/cluster.py --quick --modes hvd_fp32,defaults --rounds 4 --steps 3 \
        --json out.json                          # horovod-aq demo's timing: results as JSON

**Cluster** (``benchmarks/netns.py``; ``docs/protocol.md`` §12). N hosts are Linux network
namespaces on one bridge; each host link is shaped in both directions with a ``tc`` token
bucket (tbf) to the given rate. The kernel here has no ``netem``, so no propagation delay is
added (veth + bridge ≈ tens of µs; tbf's latency parameter only bounds its queue). Ranks are
started by the real multi-host path, ``horovodrun -np N -H addr1:1,…,addrN:1 --gloo
--network-interface IFACE``, through a stand-in ``ssh`` that enters the host's namespace (and
its own UTS namespace with the host's name). Gradient traffic therefore only crosses the shaped
links between the namespaces this script created; everything is torn down at exit, also on
failure and on SIGINT/SIGTERM. Needs root (refuses to run otherwise). Where bridged traffic
passes iptables (``net.bridge.bridge-nf-call-iptables = 1``) — e.g. next to a running dockerd,
which sets the FORWARD policy to DROP — the cluster adds ``iptables -I FORWARD -i BR -o BR -j
ACCEPT`` for its own bridge (nf_tables and/or legacy backend) and deletes it on teardown; a
2-host connection test right after the build stops the run with a clear message if the hosts
still cannot reach each other.

**Workload.** Every rank trains an MLP (default 784→4096→1536→10, ≈9.5M parameters, 38 MB of
fp32 gradient) on synthetic data, batch 32 per rank, plain SGD with momentum, one thread per
rank (``torch.set_num_threads(1)``, OMP_NUM_THREADS=1). ``--ranks-per-host L`` puts L ranks in
every host's namespace (``-H addr:L``): they talk to each other inside the host, as GPUs of one
node do, and share its one shaped link. Modes, each with its own copy of the model (same
initial weights):

* ``nocomm`` — local steps only: the compute floor (all ranks share the 2 cores);
* ``hvd_fp32`` / ``hvd_fp16`` — ``hvd.DistributedOptimizer(..., compression=hvd.Compression.
  none | .fp16)``;
* ``defaults`` — ``horovod_aq.torch.DistributedOptimizer(opt, named_parameters=...,
  compression=horovod_aq.ALQ(bits=3))`` and nothing else: what a user gets (error feedback at
  3 bits, buckets of 256, ``wire="auto"``, ``exchange="auto"``). Its first W + C·k steps are
  ``wire="auto"``'s trials (docs/protocol.md §5.5); the launch runs them before the timed
  rounds, so its timed steps use the decided wire;
* ``allgather``, ``two_phase``, ``allgather_entropy``, ``two_phase_entropy`` — the same with
  one wire forced (``exchange=`` and ``wire="fixed" | "entropy"``): the wires ``auto`` chooses
  from, so that the launch shows whether it chose well;
* ``plain_two_phase`` — ``two_phase`` with ``error_feedback=False`` (what error feedback costs);
* ``b8192_two_phase`` — the tuned row of earlier reports: ``ALQ(bits=3, bucket_size=8192)``,
  ``error_feedback=False``, ``exchange="two_phase"``, ``wire="fixed"``.

**Measurement.** Modes are interleaved in rounds (round r runs ``--steps`` steps of every mode in
turn), so slow drifts of the machine's load hit all modes alike; round 0 is warm-up (handshakes,
the ALQ refit at step 0, allocator). A step is zero_grad + forward + backward + ``opt.step()``
(which waits for the exchange); its time is the maximum over the ranks, and the table reports
the median over the timed steps, samples/s = N·batch / median, and speedups as ratios of medians
from the same launch. Bytes: each rank reads its interface's ``tx_bytes``/``rx_bytes``
(``/sys/class/net/IFACE/statistics``, the namespace's end of its link) after a barrier before
and after each block of steps; the per-step mean over the timed rounds (including TCP/IP
headers, ACKs and Horovod's control messages) is shown next to what the exchange should send:
the packed optimizer's telemetry (``bytes_sent``), or 2(P−1)/P·(4 or 2)·n for Horovod's ring
allreduce. Before each launch the script waits until the 1-minute load average is below
``--max-load`` and records the load.

Results: ``benchmarks/results/cluster.md`` and ``cluster.png`` (``--quick``: results/quick/);
with ``--json PATH`` only the results as JSON, at PATH (``horovod-aq demo`` reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import forced_wires, report
from horovod_aq.tools.launcher import kill_tree

MODES = {
    "nocomm": "no communication (local step; compute floor)",
    "hvd_fp32": "Horovod allreduce fp32 (Compression.none)",
    "hvd_fp16": "Horovod allreduce fp16 (Compression.fp16)",
    "defaults": "horovod_aq ALQ(bits=3), every default",
    **forced_wires.LABELS,
    "plain_two_phase": "two_phase + error_feedback=False",
    "b8192_two_phase": "ALQ(bits=3, bucket_size=8192), error_feedback=False, two_phase, fixed",
}
#: The packed modes' arguments beyond ``compression=ALQ(bits=...)`` (``bucket_size`` goes to
#: the compressor).
PACKED = {
    "defaults": {},
    **forced_wires.FORCED,
    "plain_two_phase": {"exchange": "two_phase", "wire": "fixed", "error_feedback": False},
    "b8192_two_phase": {"exchange": "two_phase", "wire": "fixed", "error_feedback": False,
                        "bucket_size": 8192},
}
#: The modes a run measures unless --modes says otherwise.
DEFAULT_MODES = ("nocomm", "hvd_fp32", "hvd_fp16", "defaults", "allgather", "two_phase",
                 "allgather_entropy", "two_phase_entropy")
#: The fixed wires ``defaults`` (wire="auto") chooses from (the node-aware ones with several
#: ranks per host: docs/protocol.md §5.7).
FIXED_WIRES = ("allgather", "two_phase", "allgather_entropy", "two_phase_entropy",
               "node_allgather", "node_two_phase")
#: The node-aware modes, measured where several ranks share a host.
NODE_MODES = ("node_allgather", "node_two_phase")
#: Issue 36: "auto must not pick a loss": the defaults' median step within this factor of the
#: fastest forced wire's in the same launch.
AUTO_TOLERANCE = 1.05
#: Fewer timed steps per mode than this cannot resolve AUTO_TOLERANCE on a shared 2-core host
#: (--quick times 2): the auto line is then reported (ℹ️) but not judged.
AUTO_MIN_TIMED_STEPS = 8
#: Rounds of interleaved modes (the first ``warmup_rounds`` untimed) and steps of each mode per
#: round, unless --rounds/--warmup-rounds/--steps say otherwise; --quick: plumbing, not speed.
ROUNDS = {"rounds": 5, "warmup_rounds": 1, "steps": 3}
QUICK_ROUNDS = {"rounds": 2, "warmup_rounds": 1, "steps": 2}
#: Environment of every rank: one compute thread, quiet TensorFlow, no stall warnings.
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "120"}
#: horovodrun timeouts (seconds): rank start-up, and one Gloo operation (slow links!).
START_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 600
#: Bytes target of issue 11 (the packed modes' best on every configuration).
TARGET_BYTES_FRACTION = 1 / 8
#: Issue 36's targets for the defaults row: (hosts, ranks per host, Mbit/s) → {baseline: least
#: speedup}.
TARGET_SPEEDUP = {(4, 1, 100.0): {"hvd_fp32": 8.0, "hvd_fp16": 4.0},
                  (4, 1, 1000.0): {"hvd_fp32": 3.5},
                  (2, 2, 1000.0): {"hvd_fp32": 3.0},
                  (2, 2, 100.0): {"hvd_fp32": 10.0}}
#: Issue 37's targets: (hosts, ranks per host, Mbit/s) → the least speedup of the faster
#: node-aware mode over flat two-phase; and the bytes out of each host's interface at most
#: NIC_TOLERANCE × the mode's formula (node_formula: 2(M−1)/M·N·b/8 for node_two_phase,
#: (M−1)·N·b/8 for node_allgather; b = bits + 32/B).
TARGET_NODE_SPEEDUP = {(2, 2, 1000.0): 1.4, (2, 4, 1000.0): 2.0}
NIC_TOLERANCE = 1.15


# ============================================================================ worker (one rank)


def _iface_counters(iface: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / iface / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def _install_sleep_wait(interval: float) -> None:
    """Diagnostic (``--sleep-wait``): wait for Horovod handles by polling with ``time.sleep``.

    Horovod 0.28.1's ``synchronize`` (``WaitAndClear`` in horovod/torch/mpi_ops_v2.cc) spins on
    ``std::this_thread::yield()`` until the collective is done, so a rank waiting for the
    network keeps its core busy; with 4 ranks on 2 cores that competes with the ranks that
    still compute or encode. The packed optimizer never spins (``horovod_aq.torch.optimizer.wait``
    polls and sleeps); this gives Horovod's own optimizer (the fp32/fp16 modes) a poll + sleep
    wait too, then the original call (which returns at once), to compare the exchanges without
    that difference.
    """
    import horovod.torch.mpi_ops as mpi_ops
    import horovod.torch.optimizer as hvd_optimizer

    original, poll = mpi_ops.synchronize, mpi_ops.poll

    def synchronize(handle):
        while not poll(handle):
            time.sleep(interval)
        return original(handle)

    for module in (mpi_ops, hvd_optimizer):
        if getattr(module, "synchronize", None) is original:
            module.synchronize = synchronize


def worker(cfg: dict) -> None:
    """One rank: build every mode's model and optimizer, run the interleaved rounds, report."""
    import socket

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt
    from benchmarks.models import mlp, num_parameters
    from horovod_aq.packed.cost import bytes_sent

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cfg.get("sleep_wait"):
        _install_sleep_wait(cfg["sleep_wait"])
    iface = cfg["iface"]
    sizes = cfg["sizes"]
    batch = cfg["batch"]
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(batch, sizes[0], generator=gen),
                torch.randint(0, sizes[-1], (batch,), generator=gen)) for _ in range(4)]

    def build(mode: str):
        torch.manual_seed(cfg["seed"])
        model = mlp(sizes)
        base = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        named = model.named_parameters()
        if mode == "nocomm":
            return model, base
        if mode == "hvd_fp32":
            return model, hvd.DistributedOptimizer(base, named_parameters=named,
                                                   compression=hvd.Compression.none)
        if mode == "hvd_fp16":
            return model, hvd.DistributedOptimizer(base, named_parameters=named,
                                                   compression=hvd.Compression.fp16)
        kwargs = dict(PACKED[mode])
        comp = horovod_aq.ALQ(bits=cfg["bits"], name=mode,
                              **({"bucket_size": kwargs.pop("bucket_size")}
                                 if "bucket_size" in kwargs else {}))
        return model, aqt.DistributedOptimizer(base, named_parameters=named, compression=comp,
                                               **kwargs)

    modes = cfg["modes"]
    built = {m: build(m) for m in modes}
    decided_after = {}
    if "defaults" in built:   # wire="auto"'s warm-up and trials, before the timed rounds
        model, opt = built["defaults"]
        k = 0
        while opt.autowire.decision is None and k < 200:
            x, y = batches[k % len(batches)]
            k += 1
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        decided_after = {"defaults": k}
    n = num_parameters(built[modes[0]][0])
    times: dict[str, list[list[float]]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    tx: dict[str, list[int]] = {m: [] for m in modes}
    rx: dict[str, list[int]] = {m: [] for m in modes}
    #: per round: seconds spent in encode, decode, waiting (the packed optimizer's telemetry)
    parts: dict[str, list[list[float]]] = {m: [] for m in modes}
    telemetry: dict[str, dict] = {}
    k = 0
    profiler = None
    if cfg.get("profile") and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    for rnd in range(cfg["rounds"]):
        for mode in modes:
            model, opt = built[mode]
            hvd.barrier()
            t0x, r0x = _iface_counters(iface)
            c0 = time.process_time()
            block = []
            split = [0.0, 0.0, 0.0]
            for _ in range(cfg["steps"]):
                x, y = batches[k % len(batches)]
                k += 1
                profiling = profiler is not None and rnd >= cfg["warmup_rounds"] and \
                    mode == cfg["profile"]
                if profiling:
                    profiler.enable()
                t0 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                block.append(time.perf_counter() - t0)
                if mode in PACKED:
                    extra = opt.telemetry.last.extra
                    for i, name in enumerate(("encode_s", "decode_s", "wait_s")):
                        split[i] += extra.get(name, 0.0)
                if profiling:
                    profiler.disable()
            c1 = time.process_time()
            hvd.barrier()
            t1x, r1x = _iface_counters(iface)
            times[mode].append(block)
            cpu[mode].append(c1 - c0)
            parts[mode].append(split)
            tx[mode].append(t1x - t0x)
            rx[mode].append(r1x - r0x)
    for mode in modes:
        opt = built[mode][1]
        if mode in PACKED:
            last = opt.telemetry.last
            telemetry[mode] = {"bytes_sent": last.bytes_sent, "payload_bytes": last.payload_bytes,
                               "bits_per_coordinate": last.bits_per_coordinate,
                               "bytes_fp32": last.bytes_fp32,
                               "exchanges": dict(last.exchanges),
                               "table_version": last.table_version,
                               "buckets": len(opt.buckets),
                               "nic_bytes": _nic_bytes(opt, size, hvd.local_size())}
            if mode == "defaults":
                telemetry[mode]["auto"] = _auto_choices(opt.autowire.decision)
                telemetry[mode]["auto"]["steps"] = decided_after["defaults"]
        elif mode in ("hvd_fp32", "hvd_fp16"):   # a ring: one edge leaves each host
            ring = bytes_sent(f"allreduce_{mode[4:]}", n, 0, 1, size)
            telemetry[mode] = {"bytes_sent": ring, "nic_bytes": ring if size > 1 else 0}
        else:
            telemetry[mode] = {"bytes_sent": 0}
    mine = {"rank": rank, "local_rank": hvd.local_rank(), "hostname": socket.gethostname(),
            "host": os.environ.get("HOROVOD_HOSTNAME", ""), "times": times, "cpu": cpu,
            "parts": parts, "tx": tx, "rx": rx,
            "telemetry": telemetry, "params": n}
    if profiler is not None:
        profiler.dump_stats(cfg["out"] + ".prof")
    everyone = hvd.allgather_object(mine)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps({"ranks": everyone, "size": size}))
    hvd.shutdown()


def _nic_bytes(opt, size: int, per_node: int) -> int:
    """What the packed optimizer's buckets should send out of each host per step at its code
    width (``packed.cost.nic_bytes``, fixed codes), its small tensors' ring allreduce too."""
    from horovod_aq.packed.cost import bytes_sent, nic_bytes

    comp = opt.compression
    total = sum(nic_bytes(mode, numel, comp.code_bits, comp.bucket_size, size, per_node)
                for _, numel, mode, _ in opt.buckets)
    small = sum(p.numel() for group in opt.param_groups for p in group["params"]) - sum(
        numel for _, numel, _, _ in opt.buckets)
    return total + bytes_sent("allreduce_fp32", small, 0, 1, size)


def _auto_choices(decision) -> dict:
    """What ``wire="auto"`` decided: buckets per (coding, exchange), its trial time per step
    against the fixed codes' (in the planned mode), and whether it decided (False: the
    fallback) — or that it had not decided yet."""
    if decision is None:
        return {"decided": None}
    counts: dict[str, int] = {}
    for c in decision.choices:
        key = f"{c.coding}, {c.mode}"
        counts[key] = counts.get(key, 0) + 1
    first = decision.choices[0] if decision.choices else None
    return {"decided": bool(decision.decided), "step": decision.step, "choices": counts,
            "trial_s": None if first is None else first.seconds,
            "fixed_trial_s": None if first is None else first.fixed_seconds}


# ============================================================================ driver


def wait_for_quiet(max_load: float, max_wait: float) -> str:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``max_wait`` s)."""
    t0 = time.monotonic()
    announced = False
    while True:
        load = os.getloadavg()[0]
        if load < max_load:
            return f"{load:.2f}"
        if time.monotonic() - t0 > max_wait:
            print(f"load average still {load:.2f} after {max_wait:.0f}s; measuring anyway",
                  file=sys.stderr)
            return f"{load:.2f} (did not drop below {max_load} within {max_wait:.0f}s)"
        if not announced:
            print(f"waiting for the 1-minute load average ({load:.2f}) to drop below "
                  f"{max_load} …", file=sys.stderr, flush=True)
            announced = True
        time.sleep(5)


def launch(cluster, cfg: dict, timeout: float, log_dir: Path) -> dict:
    """Run the worker on every host of ``cluster`` through horovodrun; return rank 0's JSON."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    if not horovodrun.exists():
        raise SystemExit("horovodrun not found next to the Python interpreter: run "
                         "scripts/setup.sh (it builds Horovod into .venv)")
    hosts = len(cluster.hosts)
    job = Path(tempfile.mkdtemp(prefix="aq_cluster_", dir=log_dir))
    cfg = dict(cfg, iface=cluster.iface, out=str(job / "result.json"))
    (job / "config.json").write_text(json.dumps(cfg))
    per_host = cfg.get("ranks_per_host", 1)
    cmd = [str(horovodrun), "-np", str(hosts * per_host), "-H", cluster.host_list(per_host),
           "--gloo",
           "--network-interface", cluster.iface, "--start-timeout", str(START_TIMEOUT_S),
           "--gloo-timeout-seconds", str(GLOO_TIMEOUT_S),
           sys.executable, str(Path(__file__).resolve()), "--worker", str(job / "config.json")]
    env = cluster.env()
    env.update(RANK_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    log_path = job / "horovodrun.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException:
            kill_tree(proc.pid)
            proc.wait()
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"horovodrun did not finish within {timeout:.0f}s (or was "
                               f"interrupted) and was killed; last output:\n{tail}") from None
    out = Path(cfg["out"])
    prof = Path(cfg["out"] + ".prof")
    if prof.exists():
        kept = Path(tempfile.gettempdir()) / f"cluster_{cfg['profile']}_{hosts}h.prof"
        prof.replace(kept)
        print(f"profile of rank 0: {kept}", file=sys.stderr)
    if rc != 0 or not out.exists():
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"horovodrun exited with {rc}; command: {' '.join(cmd)}\n"
                           f"last output:\n{tail}")
    return json.loads(out.read_text())


def summarize(raw: dict, cfg: dict) -> dict:
    """Per mode: median step time (max over ranks per step), bytes per step per rank."""
    ranks = raw["ranks"]
    size = raw["size"]
    warm = cfg["warmup_rounds"]
    out = {}
    for mode in cfg["modes"]:
        per_step = []
        for rnd in range(warm, cfg["rounds"]):
            for s in range(cfg["steps"]):
                per_step.append(max(r["times"][mode][rnd][s] for r in ranks))
        timed_steps = (cfg["rounds"] - warm) * cfg["steps"]
        tx = [sum(r["tx"][mode][warm:]) / timed_steps for r in ranks]
        rx = [sum(r["rx"][mode][warm:]) / timed_steps for r in ranks]
        cpu = [sum(r["cpu"][mode][warm:]) / timed_steps for r in ranks]
        # per rank: mean step time and its encode / decode / wait parts; the rest is compute
        # (forward, backward, optimizer) and the exchange's bookkeeping
        split = [[sum(p[i] for p in r["parts"][mode][warm:]) / timed_steps for i in range(3)]
                 for r in ranks]
        own = [sum(sum(b) for b in r["times"][mode][warm:]) / timed_steps for r in ranks]
        tel = ranks[0]["telemetry"][mode]
        q1, _, q3 = (statistics.quantiles(per_step, n=4, method="inclusive")
                     if len(per_step) > 1 else (per_step[0],) * 3)
        med = statistics.median(per_step)
        out[mode] = {"median": med, "q1": q1, "q3": q3, "steps": len(per_step),
                     "samples_per_s": size * cfg["batch"] / med,
                     "tx_mean": statistics.fmean(tx), "tx_max": max(tx),
                     "rx_mean": statistics.fmean(rx), "model_bytes": tel["bytes_sent"],
                     "cpu_mean": statistics.fmean(cpu),
                     "breakdown": [{"step": t, "encode": e, "decode": d, "wait": w,
                                    "other": t - e - d - w}
                                   for t, (e, d, w) in zip(own, split)],
                     "telemetry": tel}
    return out


def format_config(res: dict, cfg: dict, hosts: int, rate: float) -> tuple[str, list]:
    modes = cfg["modes"]
    s = res["summary"]
    fp32 = s.get("hvd_fp32")
    fp16 = s.get("hvd_fp16")
    rows = []
    for mode in modes:
        m = s[mode]
        sp32 = f"{fp32['median'] / m['median']:.2f}×" if fp32 else "–"
        sp16 = f"{fp16['median'] / m['median']:.2f}×" if fp16 else "–"
        frac = (f"{m['tx_mean'] / fp32['tx_mean']:.3f}" if fp32 and fp32["tx_mean"] else "–")
        model = m["model_bytes"]
        model_frac = (f"{model / fp32['model_bytes']:.3f}" if fp32 and model else "–")
        source = ("telemetry" if mode in PACKED else
                  "ring formula" if mode.startswith("hvd") else "–")
        nic = m["telemetry"].get("nic_bytes")
        rows.append([MODES[mode], f"{m['median']:.3f}", f"{m['q1']:.3f}–{m['q3']:.3f}",
                     f"{m['samples_per_s']:.0f}", sp32, sp16, f"{m['cpu_mean']:.3f}",
                     f"{m['tx_mean'] / 1e6:.2f}", frac,
                     f"{nic / 1e6:.2f}" if nic else "–",
                     f"{model / 1e6:.2f} ({source})" if model else "0", model_frac])
    table = report.markdown_table(
        ["mode", "median step (s)", "IQR (s)", "samples/s", "speedup vs fp32",
         "speedup vs fp16", "CPU s/step/rank", "measured MB out of each host/step",
         "measured ÷ fp32", "expected MB out of each host/step", "expected MB/rank/step",
         "expected ÷ fp32"], rows)
    auto = s.get("defaults", {}).get("telemetry", {}).get("auto")
    if auto is not None:
        table += "\n\n" + describe_auto(auto)
    return table + "\n\n" + format_breakdown(s, modes), rows


def describe_auto(auto: dict) -> str:
    """One line: what ``wire="auto"`` chose in this launch."""
    if auto.get("decided") is None:
        return "`wire=\"auto\"` had not decided by the end of the launch."
    choices = ", ".join(f"{n} bucket(s) {k}" for k, n in sorted(auto["choices"].items()))
    if not auto["decided"]:
        return f"`wire=\"auto\"` fell back to fixed codes from step {auto['step']}: {choices}."
    trial = (f"; its trials: {auto['trial_s']:.3f} s per step against {auto['fixed_trial_s']:.3f}"
             " s with fixed codes" if auto.get("trial_s") else "")
    return f"`wire=\"auto\"` chose, from step {auto['step']}: {choices}{trial}."


def format_breakdown(summary: dict, modes: list[str]) -> str:
    """Per rank, the packed modes' mean step split into encode, decode, waiting for the
    collectives (the optimizer's own timers) and the rest (forward, backward, update)."""
    rows = []
    for mode in modes:
        if mode not in PACKED:
            continue
        for rank, b in enumerate(summary[mode]["breakdown"]):
            rows.append([MODES[mode], str(rank), f"{b['step']:.3f}", f"{b['encode']:.3f}",
                         f"{b['decode']:.3f}", f"{b['wait']:.3f}", f"{b['other']:.3f}"])
    if not rows:
        return ""
    return ("Per-rank breakdown of the mean step (s): encode, decode + average, waiting for "
            "the collectives (the packed optimizer's timers, `StepRecord.extra`), and the rest "
            "(forward, backward, update, bookkeeping).\n\n" + report.markdown_table(
                ["mode", "rank", "mean step", "encode", "decode", "wait", "compute + other"],
                rows))


def check_targets(results: list[dict], cfg: dict) -> list[str]:
    """Issue 36's targets, one line each with ✅/❌ (only for configurations that were run).

    Speed: the ``defaults`` row against Horovod's fp32 and fp16 (``TARGET_SPEEDUP``). Auto:
    ``defaults``' median step ≤ AUTO_TOLERANCE × the fastest forced wire's (``FIXED_WIRES``),
    judged from AUTO_MIN_TIMED_STEPS timed steps per mode on. Bytes (issue 11, ℹ️): the packed
    modes' best against fp32's ring allreduce.
    """
    lines = []
    timed = (cfg["rounds"] - cfg["warmup_rounds"]) * cfg["steps"]
    for res in results:
        s, hosts, rate = res["summary"], res["hosts"], res["rate"]
        per_host = res.get("ranks_per_host", 1)
        shape = f"{hosts} hosts × {per_host} rank{'s' if per_host > 1 else ''} @ {rate:g} Mbit/s"
        if "defaults" not in s:
            continue
        for ref, target in TARGET_SPEEDUP.get((hosts, per_host, rate), {}).items():
            if ref in s:
                sp = s[ref]["median"] / s["defaults"]["median"]
                lines.append(f"{'✅' if sp >= target else '❌'} {shape}: the defaults are "
                             f"{sp:.2f}× as fast as {ref} (target ≥ {target:g}×)")
        fixed = [m for m in FIXED_WIRES if m in s]
        if fixed:
            ref = min(fixed, key=lambda m: s[m]["median"])
            ratio = s["defaults"]["median"] / s[ref]["median"]
            judged = timed >= AUTO_MIN_TIMED_STEPS
            mark = ("✅" if ratio <= AUTO_TOLERANCE else "❌") if judged else "ℹ️"
            note = "" if judged else f"; not judged: {timed} timed steps per mode"
            lines.append(f"{mark} {shape}: the defaults (wire=\"auto\") take {ratio:.2f}× "
                         f"the step of the fastest forced wire ({ref}) (≤ {AUTO_TOLERANCE:g}×: "
                         f"auto must not pick a loss{note})")
        node = [m for m in NODE_MODES if m in s]
        if node and per_host > 1:
            best = min(node, key=lambda m: s[m]["median"])
            target = TARGET_NODE_SPEEDUP.get((hosts, per_host, rate))
            if "two_phase" in s:
                sp = s["two_phase"]["median"] / s[best]["median"]
                mark = "ℹ️" if target is None else "✅" if sp >= target else "❌"
                goal = "" if target is None else f" (target ≥ {target:g}×)"
                lines.append(f"{mark} {shape}: {best} is {sp:.2f}× as fast as flat two_phase"
                             f"{goal}")
            for m in node:
                formula, text = node_formula(res, cfg, m)
                ratio = s[m]["tx_mean"] / formula
                lines.append(f"{'✅' if ratio <= NIC_TOLERANCE else '❌'} {shape}: {m} sends "
                             f"{s[m]['tx_mean'] / 1e6:.2f} MB out of each host per step, "
                             f"{ratio:.3f}× its formula {text} = "
                             f"{formula / 1e6:.2f} MB (≤ {NIC_TOLERANCE:g}×)")
        if "hvd_fp32" in s and s["hvd_fp32"]["tx_mean"]:
            packed = [m for m in s if m in PACKED]
            best = min(packed, key=lambda m: s[m]["tx_mean"])
            frac = s[best]["tx_mean"] / s["hvd_fp32"]["tx_mean"]
            lines.append(f"ℹ️ {shape}: {best} sends {frac:.3f} of fp32's bytes out of each host "
                         f"(issue 11: ≤ {TARGET_BYTES_FRACTION:.3f})")
    return lines


def node_formula(res: dict, cfg: dict, mode: str) -> tuple[float, str]:
    """Issue 37's bytes out of each node per step, and the formula as text: the node's L shards
    of N/L coordinates each cross the NIC as the exchange among the M nodes sends them,
    2(M−1)/M·N·b/8 for node_two_phase (scatter then gather) and (M−1)·N·b/8 for
    node_allgather (each shard to every other node; the same at M = 2); N every parameter,
    b = bits + 32/B (the default bucket B = 256's norms)."""
    from horovod_aq.compressors.adaptive import DEFAULT_BUCKET_SIZE

    hosts, n = res["hosts"], res["params"]
    coded = n * (cfg["bits"] + 32 / DEFAULT_BUCKET_SIZE) / 8
    if mode == "node_allgather":
        return (hosts - 1) * coded, "(M−1)·N·b/8"
    return 2 * (hosts - 1) / hosts * coded, "2(M−1)/M·N·b/8"


def plot(results: list[dict], modes: list[str], path: Path) -> None:
    from horovod_aq.tools.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels = [f"{r['hosts']} hosts × {r.get('ranks_per_host', 1)}\n{r['rate']:g} Mbit/s"
              for r in results]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vals = [r["summary"][mode]["median"] for r in results]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(results))]
        ax.bar(xs, vals, width, label=MODES[mode])
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("median step time (s, log scale)")
    ax.set_title("Emulated cluster: step time per exchange")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI: 2 hosts, 100 Mbit/s, small MLP, 2 rounds of 2 steps unless "
                        "--rounds/--steps say otherwise (plumbing and byte ratio, not speed)")
    p.add_argument("--setup", action="store_true",
                   help="install missing Debian packages (iproute2, util-linux) and exit")
    p.add_argument("--hosts", default="2,4", help="comma list of host counts (default 2,4)")
    p.add_argument("--rates", default="100,1000", help="link rates in Mbit/s (default 100,1000)")
    p.add_argument("--sizes", default=None,
                   help="MLP widths, comma list (default 784,4096,1536,10 ≈ 9.5M parameters)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of interleaved modes, the first --warmup-rounds untimed "
                        f"(default {ROUNDS['rounds']}, quick {QUICK_ROUNDS['rounds']})")
    p.add_argument("--warmup-rounds", type=int, default=None,
                   help=f"(default {ROUNDS['warmup_rounds']})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"steps of each mode per round (default {ROUNDS['steps']}, quick "
                        f"{QUICK_ROUNDS['steps']})")
    p.add_argument("--modes", default=None,
                   help=f"comma list from {list(MODES)} (default {','.join(DEFAULT_MODES)}, "
                        f"and {','.join(NODE_MODES)} with several ranks per host)")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks in every host's namespace (they share its shaped link)")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst-ms", type=float, default=None,
                   help="token bucket size as a duration at the link rate (default "
                        "netns.DEFAULT_BURST_MS)")
    p.add_argument("--max-load", type=float, default=0.7,
                   help="wait before each launch until the 1-minute load average is below this")
    p.add_argument("--load-wait", type=float, default=900,
                   help="longest wait for a quiet machine (s), then measure anyway")
    p.add_argument("--timeout", type=float, default=None,
                   help="hard limit per horovodrun launch (s; default 1800, quick 300)")
    p.add_argument("--name", default="cluster",
                   help="report name: benchmarks/results/<name>.md/.png/.json (default cluster)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the results (config and per-mode summaries, as the report's "
                        ".json) to PATH instead of the report and figure: for callers that "
                        "print their own line, such as horovod-aq demo")
    p.add_argument("--sleep-wait", type=float, default=0.0, metavar="SECONDS",
                   help="diagnostic: wait for Horovod collectives by polling with this sleep "
                        "instead of Horovod's spinning wait, in every mode (default 0: stock)")
    p.add_argument("--profile", default=None, metavar="MODE",
                   help="cProfile rank 0's timed steps of MODE; the stats file is kept and "
                        "its path printed (development aid)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.hosts, args.rates = "2", "100"
        args.sizes = args.sizes or ",".join(map(str, _quick_sizes()))
        args.max_load = float("inf")
    for key, default in (QUICK_ROUNDS if args.quick else ROUNDS).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    args.hosts = [int(h) for h in str(args.hosts).split(",")]
    args.rates = [float(r) for r in str(args.rates).split(",")]
    if args.modes is None:
        args.modes = ",".join(DEFAULT_MODES + (NODE_MODES if args.ranks_per_host > 1 else ()))
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    if args.timeout is None:
        args.timeout = 300 if args.quick else 1800
    return args


def _quick_sizes():
    from benchmarks.models import CLUSTER_MLP_QUICK

    return CLUSTER_MLP_QUICK


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    from benchmarks import netns
    from benchmarks.models import CLUSTER_MLP

    if os.geteuid() != 0:
        print("cluster.py needs root: it creates network namespaces, a bridge and tc qdiscs. "
              "Run it as root (e.g. sudo .venv/bin/python benchmarks/cluster.py).",
              file=sys.stderr)
        return 2
    netns.ensure_packages()
    if args.setup:
        print("packages present")
        return 0
    reason = netns.check_requirements()
    if reason:
        print(f"cannot build the emulated cluster: {reason}", file=sys.stderr)
        return 2
    netns.install_signal_handlers()
    stale = netns.cleanup_stale()
    if stale:
        print(f"removed leftovers of earlier runs: {', '.join(stale)}", file=sys.stderr)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(CLUSTER_MLP)
    cfg = {"sizes": sizes, "batch": args.batch, "rounds": args.rounds,
           "warmup_rounds": args.warmup_rounds, "steps": args.steps, "modes": args.modes,
           "bits": args.bits, "lr": args.lr, "seed": args.seed,
           "ranks_per_host": args.ranks_per_host,
           "profile": args.profile, "sleep_wait": args.sleep_wait}
    burst = {} if args.burst_ms is None else {"burst_ms": args.burst_ms}
    results, described = [], ""
    log_dir = Path(tempfile.mkdtemp(prefix="aq_cluster_logs_"))
    t_start = time.monotonic()
    try:
        for hosts in args.hosts:
            with netns.EmulatedCluster(hosts, args.rates[0], **burst) as cluster:
                for rate in args.rates:
                    cluster.set_rate(rate)
                    described = cluster.describe()
                    link = cluster.measure_link(1.0) if hosts > 1 else float("nan")
                    load_before = wait_for_quiet(args.max_load, args.load_wait)
                    print(f"{hosts} hosts @ {rate:g} Mbit/s (link test {link:.0f} Mbit/s, load "
                          f"{load_before}) …", file=sys.stderr, flush=True)
                    t0 = time.monotonic()
                    raw = launch(cluster, cfg, args.timeout, log_dir)
                    res = {"hosts": hosts, "rate": rate, "link_mbit": link,
                           "ranks_per_host": args.ranks_per_host,
                           "load_before": load_before, "load_after": report.loadavg(),
                           "seconds": time.monotonic() - t0, "summary": summarize(raw, cfg),
                           "hostnames": sorted({r["hostname"] for r in raw["ranks"]}),
                           "params": raw["ranks"][0]["params"]}
                    results.append(res)
                    for mode in args.modes:
                        m = res["summary"][mode]
                        print(f"  {mode:16s} {m['median']:.3f} s/step, "
                              f"{m['tx_mean'] / 1e6:.2f} MB sent/rank/step", file=sys.stderr)
    except netns.ClusterError as exc:
        print(f"emulated cluster failed: {exc}", file=sys.stderr)
        return 2
    finally:
        import shutil

        shutil.rmtree(log_dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg, "results": results,
                                               "cluster": described,
                                               "seconds": time.monotonic() - t_start},
                                              indent=1, default=str))
        return 0
    write_report(args, cfg, results, described, time.monotonic() - t_start)
    return 0


def write_report(args, cfg: dict, results: list[dict], described: str, seconds: float) -> None:
    n = results[0]["params"]
    parts = []
    for res in results:
        table, _ = format_config(res, cfg, res["hosts"], res["rate"])
        parts.append(
            f"### {res['hosts']} hosts × {res['ranks_per_host']} rank(s) @ {res['rate']:g} "
            f"Mbit/s\n\n"
            f"Link test (TCP, host 1 → host 2): {res['link_mbit']:.0f} Mbit/s; load average "
            f"before {res['load_before']}, after {res['load_after']}; ranks ran on "
            f"{', '.join(res['hostnames'])}; launch took {res['seconds']:.0f} s.\n\n{table}\n")
    targets = check_targets(results, cfg)
    timed = (cfg["rounds"] - cfg["warmup_rounds"]) * cfg["steps"]
    packed_modes = "; ".join(f"{m}: {MODES[m]}" for m in cfg["modes"] if m in PACKED)
    notes = [
        f"Cluster: {described}",
        f"Workload: MLP {'→'.join(map(str, cfg['sizes']))} ({n:,} parameters, "
        f"{4 * n / 1e6:.1f} MB fp32 gradient), batch {cfg['batch']} per rank, synthetic data, SGD "
        f"momentum 0.9, 1 thread per rank; ALQ {cfg['bits']}-bit ({packed_modes}); "
        f"{cfg.get('ranks_per_host', 1)} rank(s) per host",
        f"Timing: {cfg['rounds']} rounds × {cfg['steps']} steps per mode, interleaved; the first "
        f"{cfg['warmup_rounds']} round(s) untimed; median over {timed} timed steps of the "
        "per-step maximum over ranks; speedup = ratio of medians from the same launch",
        "Bytes: measured = interface tx_bytes delta per rank per step (mean over ranks; "
        "includes TCP/IP headers, ACKs, Horovod control traffic); expected = packed "
        "optimizer telemetry `bytes_sent` (ALQ) or ring-allreduce formula 2(P−1)/P·(4|2)·n "
        "(Horovod)",
        "CPU s/step/rank: process CPU time (all threads: Python, torch, Horovod's background "
        f"thread) per step, mean over ranks — the ranks share {os.cpu_count()} cores, so a step "
        "cannot be much shorter than this × ranks ÷ cores",
        f"Total time {seconds / 60:.1f} min",
    ]
    if cfg.get("sleep_wait"):
        notes.append(f"DIAGNOSTIC: --sleep-wait {cfg['sleep_wait']:g}: every mode waits for "
                     "Horovod handles by poll + sleep instead of Horovod's spinning "
                     "synchronize (not stock Horovod)")
    body = "\n".join(parts)
    if targets:
        body += "\n### Targets (issues 36 and 37)\n\n" + "\n".join(f"- {t}" for t in targets) + "\n"
    fig = report.figure_path(args.name, quick=args.quick)
    plot(results, cfg["modes"], fig)
    body += f"\n![step times]({fig.name})\n"
    path = report.write(args.name, "Emulated cluster: step time and bytes per exchange", body,
                        quick=args.quick, notes=notes)
    (path.with_suffix(".json")).write_text(json.dumps(
        {"config": cfg, "results": results}, indent=1, default=str))
    print(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
