"""Step time on an emulated slow-network cluster with PyTorch DDP: fp32 allreduce vs hooks.

    python benchmarks/ddp_cluster.py                 # 2 and 4 hosts × 100 Mbit/s and 1 Gbit/s
    python benchmarks/ddp_cluster.py --quick         # plumbing: 2 hosts, 100 Mbit/s, small MLP

**Cluster**: ``benchmarks/netns.py``'s ``EmulatedCluster`` (docs/protocol.md §12): N network
namespaces on one bridge, each link shaped both ways with a ``tc`` token bucket; needs root.
**Launch**: one ``torchrun --nnodes N --node-rank i --nproc-per-node L`` per host (L =
``--ranks-per-host``, default 1), started inside the host's namespace (``ip netns exec``),
static rendezvous at host 1's address over the bridge, Gloo bound to the namespace's interface
(``GLOO_SOCKET_IFNAME``), one thread per rank.

**Workload**: the MLP of ``benchmarks/cluster.py`` (784→4096→1536→10, ≈9.5M parameters) on
synthetic data, batch 32 per rank, SGD with momentum; one DDP model per mode (same initial
weights, DDP's default 25 MB buckets):

* ``ddp_fp32`` — DDP's own allreduce (no hook);
* ``ddp_fp16`` — ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``;
* ``powersgd_r2`` / ``powersgd_r4`` — PowerSGD (``powerSGD_hook``, matrix rank 2 / 4, error
  feedback and warm start, compression from iteration 2: the warm-up round covers it), with one
  DDP bucket for the whole model: the hook issues collectives from future callbacks, which on
  Gloo run in network order, and with two buckets the ranks issued them in different orders
  (Gloo: "Received data size doesn't match expected size");
* ``defaults`` — ``horovod_aq.torch.ddp.register(model, horovod_aq.ALQ(bits=3))`` and nothing
  else: what a user gets (error feedback at 3 bits, buckets of 256, ``wire="auto"``, whose
  trials run before the timed rounds, docs/protocol.md §5.5);
* ``allgather``, ``two_phase``, ``allgather_entropy``, ``two_phase_entropy`` — the same with one
  wire forced (``exchange=`` and ``wire=``): the wires ``auto`` chooses from;
* ``b8192_auto`` — the tuned row of earlier reports: ``ALQ(bits=3, bucket_size=8192)``,
  ``error_feedback=False``, ``exchange="auto"``, ``wire="fixed"``.

**Measurement** as ``benchmarks/cluster.py``: modes interleaved in rounds, round 0 untimed; a
step is zero_grad + forward + backward + ``opt.step()``; its time is the maximum over the ranks
(one ``all_reduce(MAX)`` after the block); the median over the timed steps is reported. Bytes:
each rank's interface ``tx_bytes`` (``/sys/class/net/IFACE/statistics`` inside its namespace)
around each block, after a barrier: everything sent, including TCP/IP headers and Gloo's
control traffic. Results: ``benchmarks/results/ddp_cluster.md`` (``--quick``: results/quick/).
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

from benchmarks import forced_wires, report  # noqa: E402
from horovod_aq.tools.launcher import kill_tree  # noqa: E402

MODES = {
    "ddp_fp32": "DDP allreduce fp32 (no hook)",
    "ddp_fp16": "DDP fp16_compress_hook",
    "powersgd_r2": "DDP PowerSGD hook, rank 2",
    "powersgd_r4": "DDP PowerSGD hook, rank 4",
    "defaults": "horovod_aq hook, ALQ(bits=3), every default",
    **forced_wires.LABELS,
    "b8192_auto": "ALQ(bits=3, bucket_size=8192), error_feedback=False, wire=\"fixed\"",
}
#: The hook modes' arguments beyond ``ALQ(bits=...)`` (``bucket_size`` goes to the compressor).
HOOKED = {
    "defaults": {},
    **forced_wires.FORCED,
    "b8192_auto": {"wire": "fixed", "error_feedback": False, "bucket_size": 8192},
}
#: The modes a run measures unless --modes says otherwise.
DEFAULT_MODES = ("ddp_fp32", "ddp_fp16", "powersgd_r2", "powersgd_r4", "defaults", "allgather",
                 "two_phase", "allgather_entropy", "two_phase_entropy")
#: The node-aware modes (docs/protocol.md §5.7), measured where several ranks share a host.
NODE_MODES = ("node_allgather", "node_two_phase")
#: Issue 36's targets for the defaults row: (hosts, ranks per host, Mbit/s) → least speedup
#: over DDP's fp32 allreduce.
TARGET_SPEEDUP = {(4, 1, 1000.0): 2.5, (4, 1, 100.0): 8.0}
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}
MASTER_PORT = 29731
#: DDP bucket cap of the PowerSGD modes: one bucket for the whole model (see ``worker``).
POWERSGD_BUCKET_MB = 10_000
GLOO_TIMEOUT_S = 600


# ============================================================================ worker (one rank)
def _tx_bytes(iface: str) -> int:
    return int((Path("/sys/class/net") / iface / "statistics" / "tx_bytes").read_text())


def worker(cfg: dict) -> None:
    """One rank (under torchrun): every mode's DDP model, the interleaved rounds, a report."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from benchmarks.models import mlp, num_parameters
    from horovod_aq.packed.cost import bytes_sent
    from horovod_aq.torch import ddp as aqddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    rank, size = dist.get_rank(), dist.get_world_size()
    sizes, batch = cfg["sizes"], cfg["batch"]
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(batch, sizes[0], generator=gen),
                torch.randint(0, sizes[-1], (batch,), generator=gen)) for _ in range(4)]

    def build(mode: str):
        torch.manual_seed(cfg["seed"])
        model = mlp(sizes)
        # PowerSGD issues its P and Q allreduces from future callbacks; on Gloo those run in
        # network order, so with several buckets the ranks could issue collectives in different
        # orders: it gets one bucket (no overlap with the backward pass). Every other mode keeps
        # DDP's default buckets: an explicit bucket_cap_mb=25 would also drop DDP's 1 MiB
        # first-bucket cap and fuse this MLP into one bucket.
        net = DDP(model, **({"bucket_cap_mb": POWERSGD_BUCKET_MB}
                            if mode.startswith("powersgd") else {}))
        state = None
        if mode == "ddp_fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif mode.startswith("powersgd"):
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=int(mode[-1]),
                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif mode in HOOKED:
            kwargs = dict(HOOKED[mode])
            comp = horovod_aq.ALQ(bits=cfg["bits"], name=mode,
                                  **({"bucket_size": kwargs.pop("bucket_size")}
                                     if "bucket_size" in kwargs else {}))
            state = aqddp.register(net, comp, **kwargs)
        return model, net, torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9), state

    modes = cfg["modes"]
    built = {m: build(m) for m in modes}
    n = num_parameters(built[modes[0]][0])
    k = 0
    if "defaults" in built:   # wire="auto"'s warm-up and trials, before the timed rounds
        model, net, opt, state = built["defaults"]
        while state.autowire.decision is None and k < 200:
            x, y = batches[k % len(batches)]
            k += 1
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    decided_after = k
    times = {m: [] for m in modes}
    tx = {m: [] for m in modes}
    for _ in range(cfg["rounds"]):
        for mode in modes:
            model, net, opt, _ = built[mode]
            dist.barrier()
            tx0 = _tx_bytes(cfg["iface"])
            block = []
            for _ in range(cfg["steps"]):
                x, y = batches[k % len(batches)]
                k += 1
                t0 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
                block.append(time.perf_counter() - t0)
            dist.barrier()
            tx[mode].append(_tx_bytes(cfg["iface"]) - tx0)
            slowest = torch.tensor(block, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[mode].append(slowest.tolist())
    expected = {}
    for mode in modes:
        state = built[mode][3]
        if mode in HOOKED:
            last = state.telemetry.last
            expected[mode] = {"bytes_sent": last.bytes_sent, "exchanges": dict(last.exchanges),
                              "buckets": len(state.buckets),
                              "bits_per_coordinate": last.bits_per_coordinate,
                              "table_version": last.table_version}
            decision = state.autowire.decision
            if mode == "defaults" and decision is not None:
                expected[mode]["auto"] = {"steps": decided_after, "wires": sorted(
                    {f"{c.coding}/{c.mode}" for c in decision.choices})}
        elif mode == "ddp_fp32":
            expected[mode] = {"bytes_sent": bytes_sent("allreduce_fp32", n, 0, 1, size)}
        elif mode == "ddp_fp16":
            expected[mode] = {"bytes_sent": bytes_sent("allreduce_fp16", n, 0, 1, size)}
        else:
            expected[mode] = {"bytes_sent": 0}
    mine = {"rank": rank, "times": times, "tx": tx, "expected": expected, "params": n}
    everyone = [None] * size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps({"ranks": everyone, "size": size}))
    dist.destroy_process_group()


# ============================================================================ driver
def launch(cluster, cfg: dict, timeout: float, log_dir: Path) -> dict:
    """One torchrun per host, in its namespace; return rank 0's JSON."""
    torchrun = Path(sys.executable).with_name("torchrun")
    job = Path(tempfile.mkdtemp(prefix="aq_ddp_cluster_", dir=log_dir))
    cfg = dict(cfg, iface=cluster.iface, out=str(job / "result.json"))
    (job / "config.json").write_text(json.dumps(cfg))
    hosts = cluster.hosts
    env = dict(os.environ, **RANK_ENV, GLOO_SOCKET_IFNAME=cluster.iface)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    procs, logs = [], []
    try:
        for i, host in enumerate(hosts):
            cmd = cluster.exec_argv(host, [
                str(torchrun), "--nnodes", str(len(hosts)), "--node-rank", str(i),
                "--nproc-per-node", str(cfg.get("ranks_per_host", 1)),
                "--master-addr", hosts[0].address,
                "--master-port", str(MASTER_PORT), str(Path(__file__).resolve()),
                "--worker", str(job / "config.json")])
            log = open(job / f"host{i + 1}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=ROOT, start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
        tail = (job / "host1.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"torchrun did not finish within {timeout:.0f}s (or was "
                           f"interrupted); host 1's last output:\n{tail}") from None
    finally:
        for log in logs:
            log.close()
    out = Path(cfg["out"])
    if any(p.returncode for p in procs) or not out.exists():
        tails = "\n".join(f"--- host {i + 1} (rc {p.returncode}):\n"
                          + (job / f"host{i + 1}.log").read_text(errors="replace")[-3000:]
                          for i, p in enumerate(procs))
        raise RuntimeError(f"a torchrun failed:\n{tails}")
    return json.loads(out.read_text())


def summarize(raw: dict, cfg: dict) -> dict:
    ranks, warm = raw["ranks"], cfg["warmup_rounds"]
    out = {}
    for mode in cfg["modes"]:
        steps = [t for block in ranks[0]["times"][mode][warm:] for t in block]
        timed = (cfg["rounds"] - warm) * cfg["steps"]
        tx = [sum(r["tx"][mode][warm:]) / timed for r in ranks]
        q1, _, q3 = (statistics.quantiles(steps, n=4, method="inclusive")
                     if len(steps) > 1 else (steps[0],) * 3)
        out[mode] = {"median": statistics.median(steps), "q1": q1, "q3": q3,
                     "steps": len(steps), "tx_mean": statistics.fmean(tx),
                     "expected": ranks[0]["expected"][mode]}
    return out


def format_config(summary: dict, modes: list[str]) -> str:
    fp32 = summary.get("ddp_fp32")
    rows = []
    for mode in modes:
        m = summary[mode]
        exp = m["expected"]["bytes_sent"]
        note = ""
        if mode in HOOKED:
            e = m["expected"]
            note = (f"{', '.join(f'{v} {k}' for k, v in e['exchanges'].items())}; "
                    f"{e['bits_per_coordinate']:.2f} bits/coord; table v{e['table_version']}")
            if "auto" in e:
                note += (f"; wire=\"auto\" chose {', '.join(e['auto']['wires'])} after "
                         f"{e['auto']['steps']} steps")
        rows.append([MODES[mode], f"{m['median']:.3f}", f"{m['q1']:.3f}–{m['q3']:.3f}",
                     f"{fp32['median'] / m['median']:.2f}×" if fp32 else "–",
                     f"{m['tx_mean'] / 1e6:.2f}",
                     f"{m['tx_mean'] / fp32['tx_mean']:.3f}" if fp32 and fp32["tx_mean"] else "–",
                     f"{exp / 1e6:.2f}" if exp else "–", note])
    return report.markdown_table(
        ["mode", "median step (s)", "IQR (s)", "speedup vs fp32",
         "measured MB out of each host/step", "measured ÷ fp32", "expected MB/rank/step",
         "notes"], rows)


def check_targets(results: list[dict]) -> list[str]:
    """Issue 36's targets for the hook's defaults (``TARGET_SPEEDUP``), and auto against the
    fastest forced wire (the cluster benchmark's ``AUTO_TOLERANCE``), one line each."""
    from benchmarks.cluster import AUTO_TOLERANCE

    lines = []
    for res in results:
        s, hosts, rate, per_host = res["summary"], res["hosts"], res["rate"], res["per_host"]
        shape = f"{hosts} hosts × {per_host} rank{'s' if per_host > 1 else ''} @ {rate:g} Mbit/s"
        if "defaults" not in s:
            continue
        target = TARGET_SPEEDUP.get((hosts, per_host, rate))
        if target is not None and "ddp_fp32" in s:
            sp = s["ddp_fp32"]["median"] / s["defaults"]["median"]
            lines.append(f"{'✅' if sp >= target else '❌'} {shape}: the hook's defaults are "
                         f"{sp:.2f}× as fast as DDP fp32 (target ≥ {target:g}×)")
        fixed = [m for m in ("allgather", "two_phase", "allgather_entropy", "two_phase_entropy")
                 if m in s]
        if fixed:
            ref = min(fixed, key=lambda m: s[m]["median"])
            ratio = s["defaults"]["median"] / s[ref]["median"]
            lines.append(f"{'✅' if ratio <= AUTO_TOLERANCE else '❌'} {shape}: the defaults "
                         f"(wire=\"auto\") take {ratio:.2f}× the step of the fastest forced wire "
                         f"({ref}) (≤ {AUTO_TOLERANCE:g}×)")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="plumbing: 2 hosts, 100 Mbit/s, small MLP, 2 rounds of 2 steps")
    p.add_argument("--hosts", default="2,4")
    p.add_argument("--rates", default="100,1000", help="link rates in Mbit/s")
    p.add_argument("--sizes", default=None, help="MLP widths (default 784,4096,1536,10)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default=None,
                   help=f"comma list from {list(MODES)} (default {','.join(DEFAULT_MODES)}, "
                        f"and {','.join(NODE_MODES)} with several ranks per host)")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks in every host's namespace (they share its shaped link)")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-load", type=float, default=0.7)
    p.add_argument("--load-wait", type=float, default=900)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--name", default="ddp_cluster")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        from benchmarks.models import CLUSTER_MLP_QUICK

        args.hosts, args.rates = "2", "100"
        args.sizes = args.sizes or ",".join(map(str, CLUSTER_MLP_QUICK))
        args.rounds, args.warmup_rounds, args.steps = 3, 1, 2
        args.max_load, args.timeout = float("inf"), 300
    args.hosts = [int(h) for h in str(args.hosts).split(",")]
    args.rates = [float(r) for r in str(args.rates).split(",")]
    if args.modes is None:
        args.modes = ",".join(DEFAULT_MODES + (NODE_MODES if args.ranks_per_host > 1 else ()))
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(args.modes) - set(MODES))}; choose from {list(MODES)}")
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        from horovod_aq.torch.process_exit import destroy_and_exit

        worker(json.loads(Path(args.worker).read_text()))
        destroy_and_exit()     # PyTorch's Gloo shutdown race, docs/ddp.md §6
    from benchmarks import netns
    from benchmarks.cluster import wait_for_quiet
    from benchmarks.models import CLUSTER_MLP

    if os.geteuid() != 0:
        print("ddp_cluster.py needs root (network namespaces, a bridge, tc qdiscs)",
              file=sys.stderr)
        return 2
    reason = netns.check_requirements()
    if reason:
        print(f"cannot build the emulated cluster: {reason}", file=sys.stderr)
        return 2
    netns.install_signal_handlers()
    netns.cleanup_stale()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(CLUSTER_MLP)
    cfg = {"sizes": sizes, "batch": args.batch, "rounds": args.rounds,
           "warmup_rounds": args.warmup_rounds, "steps": args.steps, "modes": args.modes,
           "bits": args.bits, "lr": args.lr, "seed": args.seed,
           "ranks_per_host": args.ranks_per_host}
    sections, raw_all, described = [], [], ""
    log_dir = Path(tempfile.mkdtemp(prefix="aq_ddp_cluster_logs_"))
    started = time.monotonic()
    for hosts in args.hosts:
        with netns.EmulatedCluster(hosts, args.rates[0]) as cluster:
            for rate in args.rates:
                cluster.set_rate(rate)
                described = cluster.describe()
                load = wait_for_quiet(args.max_load, args.load_wait)
                link = cluster.measure_link() if hosts >= 2 else float("nan")
                print(f"{hosts} hosts @ {rate:g} Mbit/s (link test {link:.1f} Mbit/s, load "
                      f"{load}) …", file=sys.stderr, flush=True)
                raw = launch(cluster, cfg, args.timeout, log_dir)
                summary = summarize(raw, cfg)
                raw_all.append({"hosts": hosts, "rate": rate, "load": load, "link": link,
                                "per_host": args.ranks_per_host, "summary": summary})
                sections.append(f"### {hosts} hosts × {args.ranks_per_host} rank(s), {rate:g} "
                                f"Mbit/s (link test {link:.1f} "
                                f"Mbit/s; load average before: {load})\n\n"
                                + format_config(summary, args.modes))
                print(sections[-1], file=sys.stderr, flush=True)
    params = raw["ranks"][0]["params"]
    body = "\n\n".join([
        f"MLP {'→'.join(map(str, sizes))} ({params / 1e6:.2f}M parameters, "
        f"{4 * params / 1e6:.1f} MB fp32 gradient), batch {args.batch}/rank, "
        f"{args.rounds - args.warmup_rounds} timed rounds × {args.steps} steps per mode "
        f"(+{args.warmup_rounds} warm-up), modes interleaved. Step = max over ranks; bytes = "
        "the namespace interface's tx_bytes (all traffic), per rank per step; expected = ring "
        "formulas (fp32/fp16) or the hook's telemetry (ALQ); PowerSGD's is not modelled. "
        "DDP's default buckets (this MLP: 2) except PowerSGD, which gets one bucket: it issues "
        "collectives from future callbacks, and on Gloo two buckets made the ranks issue them "
        "in different orders. 4 ranks share the machine's cores; the load average before each "
        "launch is given (other jobs ran on the machine).",
        f"Cluster: {described}.", *sections,
        "### Targets (issue 36)\n\n" + "\n".join(f"- {t}" for t in check_targets(raw_all)),
        f"Total wall time {time.monotonic() - started:.0f} s."])
    path = report.write(args.name, "DDP on an emulated cluster: fp32 vs fp16, PowerSGD, ALQ hooks",
                        body, quick=args.quick)
    (path.with_suffix(".json")).write_text(json.dumps(raw_all, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
