"""An emulated cluster on one machine: hosts as Linux network namespaces joined by a bridge.

Used by ``benchmarks/cluster.py``; facts behind the design are in ``docs/protocol.md``
§12 ("Emulated multi-host runs"):

* **Topology.** One Linux bridge in the root namespace (the driver's side, where ``horovodrun``
  runs) and, per host, a network namespace holding one end of a veth pair; the other end is a
  port of the bridge. The bridge and the interface inside *every* namespace have the **same
  name**, so one ``horovodrun --network-interface NAME`` is valid for the driver (it advertises
  the bridge's address for the Gloo rendezvous) and for every worker.
* **Links.** Each host link is shaped with a token bucket (``tc qdisc … tbf``) in both
  directions: on the namespace's interface (host egress) and on the bridge-side veth (host
  ingress). The kernel here has no ``netem`` qdisc, so no propagation delay is added: the
  only latency is the veth/bridge path (tens of µs) plus queueing in the token bucket (whose
  ``latency`` parameter bounds the queue, it does not add delay).
* **Remote launch.** :meth:`EmulatedCluster.env` puts a stand-in ``ssh`` first on ``PATH``.
  It accepts what ``horovodrun`` passes (``ssh -o … HOST [-p P] [-o …] 'cd DIR ; env … CMD'``,
  options before and after the host), maps the host address to its namespace and runs the
  command there with ``ip netns exec NS unshare --uts`` after setting the host's own hostname,
  so Horovod's real multi-host launch path is exercised without an ssh server. Each namespace
  gets ``/etc/netns/NS/hosts`` (``ip netns exec`` bind-mounts it over ``/etc/hosts``) mapping
  every emulated host name to its address.
* **Firewall (Docker).** With ``br_netfilter`` loaded and ``net.bridge.bridge-nf-call-iptables
  = 1``, frames crossing a Linux bridge traverse iptables' FORWARD chain, and a running
  ``dockerd`` sets that chain's policy to DROP: the namespaces could then reach the driver
  (INPUT) but not each other. So while the sysctl is 1, :class:`EmulatedCluster` inserts
  ``-I FORWARD 1 -i BR -o BR -j ACCEPT`` (traffic between ports of its own bridge, nothing else)
  into every iptables backend whose filter table exists — ``iptables-nft`` (nf_tables) and/or
  ``iptables-legacy``; both can hold rules at once and the kernel applies both — and deletes
  them on teardown. Without an ``iptables`` binary no rule is added; either way a 2-host
  connection test right after the build turns a blocked bridge into a :class:`ClusterError`
  that says what to do, instead of a Gloo timeout later.
* **Isolation and cleanup.** Every name carries a per-run tag (``aqc<pid>``), the subnet is a
  free 10.231.x.0/24, and :meth:`EmulatedCluster.close` (also run at interpreter exit and on
  SIGINT/SIGTERM/SIGHUP through :func:`install_signal_handlers`) kills the processes left in
  the namespaces, deletes the namespaces (which deletes the veth pairs), the bridge, its
  FORWARD rules, the ``/etc/netns`` entries and the stand-in ``ssh``. :func:`cleanup_stale`
  removes what a killed earlier run (whose pid no longer exists) left behind, rules included.

Needs root, ``ip`` and ``tc`` (Debian ``iproute2``) and ``unshare``/``hostname``
(``util-linux``/``hostname``); :func:`check_requirements` says what is missing. ``iptables``
(Debian ``iptables``) is used when present.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

#: Prefix of every interface, namespace and /etc/netns entry this module creates.
TAG_PREFIX = "aqc"
#: Second octet pair of the emulated subnets: 10.231.<x>.0/24.
SUBNET_BASE = "10.231"
#: Host i gets address .(HOST_OFFSET + i); the bridge (driver side) gets .1.
HOST_OFFSET = 10
#: Token-bucket size as a duration at the link rate (at least MIN_BURST_BYTES).
DEFAULT_BURST_MS = 5.0
MIN_BURST_BYTES = 32 * 1024
#: Longest a packet may wait in the token bucket's queue before being dropped (tbf ``latency``).
DEFAULT_QUEUE_MS = 500.0
NETNS_ETC = Path("/etc/netns")
REQUIRED_TOOLS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux",
                  "hostname": "hostname"}
#: Whether bridged IPv4 frames pass iptables (br_netfilter; absent when the module is not loaded).
BRIDGE_NF_SYSCTL = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
#: Legacy (x_tables) IPv4 tables that exist in this network namespace, one name per line.
LEGACY_TABLES = Path("/proc/net/ip_tables_names")
#: Seconds the connection test between two hosts waits before declaring the bridge blocked.
CONNECT_TIMEOUT_S = 3.0


class ClusterError(RuntimeError):
    """Setting up or using the emulated cluster failed (the message says what to do)."""


def _run(argv: Sequence[str], *, check: bool = True, capture: bool = True,
         timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=capture, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed ({proc.returncode}): {' '.join(argv)}\n"
                           f"{(proc.stderr or '').strip()}")
    return proc


def check_requirements() -> str | None:
    """None if this machine can build the emulated cluster, else the reason it cannot."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return ("the emulated cluster needs root (it creates network namespaces, a bridge and "
                "tc qdiscs); run as root, e.g. with sudo")
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if shutil.which(tool) is None})
    if missing:
        return (f"missing tools from the Debian packages {', '.join(missing)}: "
                f"apt-get install -y {' '.join(missing)} (cluster.py --setup does this)")
    probe = f"{TAG_PREFIX}probe{os.getpid()}"
    proc = _run(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return f"`ip netns add` does not work here: {proc.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def ensure_packages() -> None:
    """Install the Debian packages that provide the missing tools (needs root and apt)."""
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise ClusterError(f"missing packages {missing} and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", *missing]):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed:\n{proc.stderr[-2000:]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> None:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in proc.stdout.split() if p.strip().isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(_pid_alive(p) for p in alive):
            time.sleep(0.1)
        pids = [p for p in alive if _pid_alive(p)]


# ---------------------------------------------------------------------- iptables (Docker)
def bridge_traffic_filtered() -> bool:
    """True when frames crossing a bridge pass iptables' FORWARD chain (br_netfilter loaded and
    ``net.bridge.bridge-nf-call-iptables = 1``, as Docker leaves it)."""
    try:
        return BRIDGE_NF_SYSCTL.read_text().strip() == "1"
    except OSError:
        return False


def _iptables_kind(binary: str) -> str | None:
    """"nft" or "legacy" for an ``iptables`` binary, from ``iptables --version``."""
    proc = _run([binary, "--version"], check=False)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return None
    return "nft" if "nf_tables" in text else "legacy"


def _backend_in_use(binary: str, kind: str) -> bool:
    """Whether the IPv4 filter table exists in this backend (only then can it drop anything).
    Checked without creating the table or loading a module: ``/proc/net/ip_tables_names`` for
    legacy, ``iptables-nft-save`` (which prints no table that does not exist) for nf_tables."""
    if kind == "legacy":
        try:
            return "filter" in LEGACY_TABLES.read_text().split()
        except OSError:
            return False
    save = shutil.which(f"{binary}-save")        # iptables-nft-save, or iptables-save
    if save is None:
        return True          # cannot tell: inserting into an empty table is harmless
    proc = _run([save], check=False)
    return proc.returncode == 0 and re.search(r"^\*filter\s*$", proc.stdout, re.M) is not None


def iptables_backends() -> list[tuple[str, str]]:
    """(binary, kind) of every iptables backend whose filter table is in use here.

    Debian ships ``iptables-nft`` and ``iptables-legacy`` side by side (``iptables`` points to
    one of them); rules in either apply, so both are looked at. A system with only a plain
    ``iptables`` is classified by its ``--version``. No binary at all: an empty list."""
    found: dict[str, str] = {}
    for binary, kind in (("iptables-nft", "nft"), ("iptables-legacy", "legacy")):
        path = shutil.which(binary)
        if path:
            found.setdefault(kind, path)
    if not found:
        path = shutil.which("iptables")
        kind = _iptables_kind(path) if path else None
        if kind:
            found[kind] = path
    return [(b, k) for k, b in sorted(found.items()) if _backend_in_use(b, k)]


def _forward_rule(bridge: str) -> list[str]:
    return ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def forward_rules(binary: str) -> list[str]:
    """The interfaces X with a ``-A FORWARD -i X -o X -j ACCEPT`` rule (the form this module
    adds for its bridges) in ``binary``'s FORWARD chain, once per copy of the rule."""
    proc = _run([binary, "-w", "10", "-S", "FORWARD"], check=False)
    return re.findall(r"^-A FORWARD -i (\S+) -o \1 -j ACCEPT\s*$", proc.stdout, flags=re.MULTILINE)


def add_forward_rules(bridge: str) -> tuple[list[str], list[str]]:
    """Accept forwarding between the ports of ``bridge`` in every iptables backend in use.

    Returns (backends that got the rule, problems). Nothing to do (empty lists) when bridged
    traffic does not pass iptables. Never raises: what a missing rule breaks is found by the
    connection test, whose message includes these problems."""
    if not bridge_traffic_filtered():
        return [], []
    backends = iptables_backends()
    if not backends:
        if shutil.which("iptables") or shutil.which("iptables-nft") \
                or shutil.which("iptables-legacy"):
            return [], []        # iptables present, but no filter table: nothing can drop
        return [], [f"no iptables binary was found, so no ACCEPT rule was added for {bridge}"]
    added, problems = [], []
    for binary, kind in backends:
        rule = _forward_rule(bridge)
        proc = _run([binary, "-w", "10", "-I", rule[0], "1", *rule[1:]], check=False)
        if proc.returncode == 0:
            added.append(kind)
        else:
            problems.append(f"`{os.path.basename(binary)} -I FORWARD 1 -i {bridge} -o {bridge} "
                            f"-j ACCEPT` failed: {(proc.stderr or proc.stdout).strip()}")
    return added, problems


def remove_forward_rules(bridge: str) -> list[str]:
    """Delete every copy of ``bridge``'s ACCEPT rule from every backend; returns the errors."""
    errors = []
    for binary, _kind in iptables_backends():
        for _ in range(forward_rules(binary).count(bridge)):
            proc = _run([binary, "-w", "10", "-D", *_forward_rule(bridge)], check=False)
            if proc.returncode != 0:
                errors.append(f"{os.path.basename(binary)} -D FORWARD -i {bridge} -o {bridge} "
                              f"-j ACCEPT: {(proc.stderr or proc.stdout).strip()}")
                break
    return errors


def _remove(tag: str, namespaces: Sequence[str]) -> list[str]:
    """Delete everything named after ``tag``; returns the errors (teardown never raises)."""
    errors = []
    for ns in namespaces:
        try:
            _kill_netns_pids(ns)
        except Exception as exc:  # noqa: BLE001 - keep tearing down
            errors.append(f"killing processes in {ns}: {exc}")
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and "No such file" not in proc.stderr:
            errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    # veth peers disappear with their namespace; remove any root-side leftovers and the bridge
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for name in re.findall(r"^\d+:\s+([^:@\s]+)", links, flags=re.MULTILINE):
        if name == tag or re.fullmatch(rf"{re.escape(tag)}[vp]\d+", name):
            proc = _run(["ip", "link", "del", name], check=False)
            if proc.returncode != 0 and "Cannot find" not in proc.stderr:
                errors.append(f"ip link del {name}: {proc.stderr.strip()}")
    try:
        errors += remove_forward_rules(tag)
    except Exception as exc:  # noqa: BLE001 - keep tearing down
        errors.append(f"removing the iptables FORWARD rules of {tag}: {exc}")
    return errors


def cleanup_stale() -> list[str]:
    """Remove namespaces/bridges of earlier runs whose process is gone; returns their tags."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    by_tag: dict[str, list[str]] = {}
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"({TAG_PREFIX}(\d+))h\d+", name)
        if m and not _pid_alive(int(m.group(2))):
            by_tag.setdefault(m.group(1), []).append(name)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for name in re.findall(r"^\d+:\s+([^:@\s]+)", links, flags=re.MULTILINE):
        m = re.fullmatch(rf"({TAG_PREFIX}(\d+))", name)
        if m and not _pid_alive(int(m.group(2))):
            by_tag.setdefault(m.group(1), [])
    for binary, _kind in iptables_backends():
        for bridge in forward_rules(binary):
            m = re.fullmatch(rf"{TAG_PREFIX}(\d+)", bridge)
            if m and not _pid_alive(int(m.group(1))):
                by_tag.setdefault(bridge, [])
    for tag, namespaces in by_tag.items():
        _remove(tag, namespaces)
    return sorted(by_tag)


def _free_subnet() -> str:
    used = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    used += _run(["ip", "-4", "route", "show"], check=False).stdout
    start = os.getpid() % 250
    for k in range(250):
        third = (start + k) % 250 + 1
        prefix = f"{SUBNET_BASE}.{third}."
        if prefix not in used:
            return prefix
    raise ClusterError(f"no free subnet {SUBNET_BASE}.x.0/24 left")


@dataclasses.dataclass(frozen=True)
class Host:
    index: int        #: 1-based
    name: str         #: hostname inside its UTS namespace (and in /etc/netns/NS/hosts)
    namespace: str
    address: str
    root_veth: str    #: the bridge-side end of the host's link (root namespace)


_SSH_TEMPLATE = """\
#!/bin/bash
# Stand-in ssh written by benchmarks/netns.py for an emulated cluster: maps a host of the
# emulated cluster to its network namespace. Usage as ssh: ssh [opts] HOST [opts] [COMMAND...]
host=""; cmd=()
while [ $# -gt 0 ]; do
  if [ ${{#cmd[@]}} -eq 0 ]; then
    case "$1" in
      -o|-p|-i|-l|-F|-E|-c|-m|-b|-J|-L|-R|-D|-W|-S|-O|-Q) shift 2; continue;;
      -*) shift; continue;;
    esac
    if [ -z "$host" ]; then host="$1"; shift; continue; fi
  fi
  cmd+=("$1"); shift
done
case "$host" in
{cases}
  *) echo "stand-in ssh: $host is not a host of emulated cluster {tag}" >&2; exit 255;;
esac
if [ ${{#cmd[@]}} -eq 0 ]; then
  echo "stand-in ssh: no command (interactive login unsupported)" >&2; exit 255
fi
exec ip netns exec "$ns" unshare --uts -- \\
  /bin/sh -c 'hostname "$0" && exec /bin/bash -c "$1"' "$name" "${{cmd[*]}}"
"""


class EmulatedCluster:
    """``hosts`` namespaces on a bridge, each link shaped to ``rate_mbit`` in both directions.

    Use as a context manager (or call :meth:`close`); teardown also runs at interpreter exit.
    """

    def __init__(self, hosts: int, rate_mbit: float, *, burst_ms: float = DEFAULT_BURST_MS,
                 queue_ms: float = DEFAULT_QUEUE_MS, tag: str | None = None) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        reason = check_requirements()
        if reason:
            raise ClusterError(reason)
        self.tag = tag or f"{TAG_PREFIX}{os.getpid()}"
        if len(self.tag) + 4 > 15:
            raise ValueError(f"tag {self.tag!r} too long for interface names")
        self.iface = self.tag                  # bridge name == interface name in every namespace
        self.rate_mbit = float(rate_mbit)
        self.burst_ms = float(burst_ms)
        self.queue_ms = float(queue_ms)
        self.hosts: list[Host] = []
        #: iptables backends ("nft", "legacy") that got the bridge's FORWARD ACCEPT rule
        self.firewall: list[str] = []
        self._closed = False
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.tag}_"))
        self.bin_dir = self._tmp / "bin"
        atexit.register(self.close)
        try:
            self._build(hosts)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _build(self, n: int) -> None:
        prefix = _free_subnet()
        self.driver_address = f"{prefix}1"
        br = self.iface
        _run(["ip", "link", "add", br, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.driver_address}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        self.firewall, firewall_problems = add_forward_rules(br)
        for i in range(1, n + 1):
            host = Host(i, f"{self.tag}h{i}", f"{self.tag}h{i}", f"{prefix}{HOST_OFFSET + i}",
                        f"{self.tag}v{i}")
            self.hosts.append(host)
            ns, rv, tmp = host.namespace, host.root_veth, f"{self.tag}p{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", rv, "type", "veth", "peer", "name", tmp])
            _run(["ip", "link", "set", tmp, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", tmp, "name", br])
            _run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", br])
            _run(["ip", "-n", ns, "link", "set", br, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", rv, "master", br])
            _run(["ip", "link", "set", rv, "up"])
        self.set_rate(self.rate_mbit)
        hosts_file = ("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
                      f"{self.driver_address} {self.tag}driver\n"
                      + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        for h in self.hosts:
            (NETNS_ETC / h.namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.namespace / "hosts").write_text(hosts_file)
        self.bin_dir.mkdir(parents=True)
        cases = "\n".join(f"  {h.address}|{h.name}) ns={h.namespace}; name={h.name};;"
                          for h in self.hosts)
        ssh = self.bin_dir / "ssh"
        ssh.write_text(_SSH_TEMPLATE.format(cases=cases, tag=self.tag))
        ssh.chmod(0o755)
        if n >= 2:
            reason = self.check_connectivity()
            if reason:
                raise ClusterError(self._blocked_message(reason, firewall_problems))

    def check_connectivity(self, src: int = 0, dst: int = 1,
                           timeout: float = CONNECT_TIMEOUT_S) -> str | None:
        """None if host ``src`` opens a TCP connection to host ``dst`` (0-based) across the
        bridge, else what went wrong."""
        a, b = self.hosts[src], self.hosts[dst]
        port = 28000 + os.getpid() % 1000
        server = (f"import socket; s = socket.socket(); s.settimeout({timeout + 2}); "
                  "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                  f"s.bind(('{b.address}', {port})); s.listen(1); print('ready', flush=True); "
                  "s.accept()[0].close()")
        client = (f"import socket; socket.create_connection(('{b.address}', {port}), "
                  f"timeout={timeout}).close()")
        srv = subprocess.Popen(self.exec_argv(b, [sys.executable, "-c", server]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if srv.stdout.readline().strip() != "ready":
                return f"the test server on {b.name} did not start: {srv.stderr.read().strip()}"
            proc = _run(self.exec_argv(a, [sys.executable, "-c", client]), check=False,
                        timeout=timeout + 30)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                return f"{a.name} ({a.address}) -> {b.name} ({b.address}:{port}): {last}"
            return None
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.communicate()

    def _blocked_message(self, reason: str, firewall_problems: list[str]) -> str:
        br = self.iface
        lines = [f"hosts of the emulated cluster cannot reach each other over bridge {br}: "
                 f"{reason}"]
        if bridge_traffic_filtered():
            lines.append(f"bridged traffic passes iptables ({BRIDGE_NF_SYSCTL} = 1); a running "
                         "dockerd sets the FORWARD policy to DROP (see `iptables -S FORWARD`)")
            if self.firewall:
                lines.append(f"the ACCEPT rule for {br} was added ({', '.join(self.firewall)}), "
                             "so another firewall (nftables, firewalld, ebtables) drops it")
            lines += firewall_problems
            fixes = [f"allow forwarding between the ports of bridges named {TAG_PREFIX}* in "
                     "your firewall",
                     "run `sysctl -w net.bridge.bridge-nf-call-iptables=0` (this also turns off "
                     "iptables filtering between Docker containers on one bridge)"]
            if not iptables_backends() and not any(
                    shutil.which(b) for b in ("iptables", "iptables-nft", "iptables-legacy")):
                fixes.insert(0, "install iptables (apt-get install -y iptables) so that this "
                                f"script adds `iptables -I FORWARD -i {br} -o {br} -j ACCEPT` "
                                "itself")
            lines.append("fix: " + "; or ".join(fixes))
        return "\n  ".join(lines)

    def _tbf(self, rate_mbit: float) -> list[str]:
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes * self.burst_ms / 1e3))
        return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst),
                "latency", f"{self.queue_ms:g}ms"]

    def set_rate(self, rate_mbit: float) -> None:
        """(Re)shape every host link to ``rate_mbit`` in both directions."""
        spec = self._tbf(rate_mbit)
        for h in self.hosts:
            _run(["ip", "netns", "exec", h.namespace, "tc", "qdisc", "replace", "dev", self.iface,
                  "root", *spec])
            _run(["tc", "qdisc", "replace", "dev", h.root_veth, "root", *spec])
        self.rate_mbit = float(rate_mbit)

    def describe(self) -> str:
        spec = " ".join(self._tbf(self.rate_mbit))
        return (f"{len(self.hosts)} namespaces {self.hosts[0].namespace}…, bridge {self.iface} "
                f"({self.driver_address}/24), interface {self.iface} in every namespace; each link "
                f"shaped both ways with `tc qdisc … {spec}`; no added propagation delay (no netem "
                "qdisc in this kernel)"
                + (f"; bridged traffic passes iptables, forwarding on {self.iface} accepted by a "
                   f"FORWARD rule added for the run ({', '.join(self.firewall)})"
                   if self.firewall else ""))

    # ------------------------------------------------------------------ use
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose ``PATH`` starts with the stand-in ``ssh``."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def host_list(self, slots: int = 1) -> str:
        """The ``horovodrun -H`` argument: ``addr1:slots,addr2:slots,…``."""
        return ",".join(f"{h.address}:{slots}" for h in self.hosts)

    def exec_argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", host.namespace, *argv]

    def root_counters(self, host: Host) -> tuple[int, int]:
        """(bytes the host sent, bytes it received), read on the bridge side of its link."""
        base = Path("/sys/class/net") / host.root_veth / "statistics"
        return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())

    def measure_link(self, seconds: float = 1.0, src: int = 0, dst: int = 1) -> float:
        """TCP throughput (Mbit/s) from host ``src`` to host ``dst`` (0-based), a few lines of
        Python on both ends (no iperf/ping on this machine)."""
        a, b = self.hosts[src], self.hosts[dst]
        port = 29000 + os.getpid() % 1000
        receiver = textwrap.dedent(f"""
            import socket, time
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("{b.address}", {port})); s.listen(1); print("ready", flush=True)
            c, _ = s.accept(); n = 0; t0 = None
            while True:
                d = c.recv(1 << 20)
                if not d: break
                if t0 is None: t0 = time.perf_counter()
                n += len(d)
            print(n * 8 / (time.perf_counter() - t0) / 1e6)
        """)
        sender = textwrap.dedent(f"""
            import socket, time
            c = socket.create_connection(("{b.address}", {port}), timeout=10)
            buf = b"x" * (1 << 16); t_end = time.perf_counter() + {seconds}
            while time.perf_counter() < t_end: c.sendall(buf)
            c.close()
        """)
        recv = subprocess.Popen(self.exec_argv(b, [sys.executable, "-c", receiver]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = recv.stdout.readline()
            if line.strip() != "ready":
                raise ClusterError(f"link test receiver failed: {recv.stderr.read()}")
            _run(self.exec_argv(a, [sys.executable, "-c", sender]), timeout=seconds + 60)
            out, _ = recv.communicate(timeout=seconds + 60)
            return float(out.strip())
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Remove everything this cluster created (idempotent; never raises)."""
        if self._closed:
            return
        self._closed = True
        errors = _remove(self.tag, [h.namespace for h in self.hosts])
        shutil.rmtree(self._tmp, ignore_errors=True)
        if errors:
            print("emulated cluster teardown: " + "; ".join(errors), file=sys.stderr)

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit (and keep SIGINT's KeyboardInterrupt), so ``finally``
    blocks and atexit handlers tear the cluster down when the benchmark is killed."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def local_addresses() -> set[str]:
    """IPv4 addresses of this namespace (to check that a worker runs on its emulated host)."""
    out = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    return set(re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)) | {socket.gethostbyname("localhost")}
