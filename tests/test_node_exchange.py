"""The node-aware exchange (docs/protocol.md §5.7): the topology, its cost model, and the
Horovod optimizer on 4 real ranks declared as 2 nodes of 2 (``HOROVOD_AQ_TOPOLOGY=2x2``).

The numpy codec is the oracle, as in tests/test_torch_optimizer.py: every rank's gradient after
``synchronize()`` must be bitwise the float32 node average of each shard (summed in local-rank
order, divided by L), exchanged between the nodes with the payloads the ranks encoded, and
concatenated. The DDP hook's node-aware launch is in tests/test_ddp.py.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.levels import LevelTable
from horovod_aq.packed import choice, cost
from horovod_aq.packed.topology import TOPOLOGY_ENV, Topology, parse_shape, topology_for
from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_torch, tiny_model

BUCKET = 64          # quantization bucket (coordinates)
FUSION_BYTES = 2600  # buckets [2.bias, 2.weight] (650), [0.bias] (64: its second shard is
                     # empty), [0.weight] (1280)
NODES, PER_NODE = 2, 2


# ================================================================ the topology and its model
def test_shapes_parse_and_refuse_what_they_cannot_mean():
    assert parse_shape("2x4") == (2, 4) and parse_shape(" 3 × 2 ") == (3, 2)
    assert parse_shape("flat") is None
    for bad in ("2", "2x", "x2", "0x4", "2x0", "two by two"):
        with pytest.raises(ValueError, match="MxL"):
            parse_shape(bad)


def test_the_topology_comes_from_the_declaration_then_the_launcher(monkeypatch, caplog):
    monkeypatch.delenv(TOPOLOGY_ENV, raising=False)
    t = topology_for(3, 4, local_rank=1, local_size=2)
    assert t == Topology(2, 2, 1, 1) and t.rank == 3
    assert t.node_peers() == [2, 3] and t.cross_peers() == [1, 3]
    assert topology_for(5, 8, local_rank=1, local_size=4).cross_peers() == [1, 5]
    # one node, one rank per node, no launcher information: flat
    assert topology_for(1, 4, local_rank=1, local_size=4) is None
    assert topology_for(1, 4, local_rank=0, local_size=1) is None
    assert topology_for(1, 4) is None
    # a numbering that is not node by node: flat, and the log says how to declare it
    with caplog.at_level(logging.INFO, logger="horovod_aq.packed.topology"):
        assert topology_for(1, 4, local_rank=0, local_size=2) is None
    assert TOPOLOGY_ENV in caplog.text
    # the declaration wins over the launcher, and must cover the job
    monkeypatch.setenv(TOPOLOGY_ENV, "2x2")
    assert topology_for(2, 4, local_rank=2, local_size=4) == Topology(2, 2, 1, 0)
    monkeypatch.setenv(TOPOLOGY_ENV, "flat")
    assert topology_for(3, 4, local_rank=1, local_size=2) is None
    monkeypatch.setenv(TOPOLOGY_ENV, "2x4")
    with pytest.raises(ValueError, match="declares 8 ranks, but the job has 4"):
        topology_for(0, 4)
    assert topology_for(0, 4, declared="1x4") is None


@pytest.mark.parametrize("numel", [1, 63, 64, 100, 1000, 4097, 9_500_000])
@pytest.mark.parametrize("per_node", [2, 3, 8])
def test_shards_tile_the_bucket_in_whole_quantization_buckets(numel, per_node):
    spans = [cost.shard_span(numel, per_node, BUCKET, j) for j in range(per_node)]
    at = 0
    for lo, n in spans:
        assert lo == at and n >= 0
        at += n
    assert at == numel
    full = [n for _, n in spans if n]   # every shard but the last non-empty one: whole buckets
    assert all(n % BUCKET == 0 and n == full[0] for n in full[:-1])


def test_bytes_out_of_each_node_follow_the_formula():
    """Per NIC, node-aware two-phase: 2(M−1)/M·N·b/8 with b = bits + 32/B (norms), plus the
    payload headers; flat: L times a rank's bytes to the other nodes; the ring: one edge."""
    n, bits, B = 9_500_000, 3, 256
    for M, L in ((2, 2), (2, 4), (4, 2), (8, 8)):
        P = M * L
        formula = 2 * (M - 1) / M * n * (bits + 32 / B) / 8
        nic = cost.nic_bytes("node_two_phase", n, bits, B, P, L)
        assert formula <= nic <= 1.01 * formula, (M, L, nic / formula)
        # flat two-phase: each rank sends 2(P−1) chunks of N/P, 2(P−L) of them off the node
        flat = cost.nic_bytes("two_phase", n, bits, B, P, L)
        assert flat / nic == pytest.approx(L * (P - L) / P * M / (M - 1), rel=0.02)
        # each rank sends its L − 1 foreign shards and its own shard to L − 1 peers in fp32
        inside = cost.bytes_sent("node_two_phase", n, bits, B, P, L) - nic // L
        assert inside == pytest.approx(2 * (L - 1) / L * 4 * n, rel=1e-3)


def test_the_model_picks_node_aware_on_a_topology_and_refuses_it_without_one():
    n, bits, B = 9_500_000, 3, 256
    assert cost.choose_exchange(n, bits, B, 4) in cost.FLAT_MODES
    assert cost.choose_exchange(n, bits, B, 4, per_node=2) == "node_allgather"    # M = 2
    assert cost.choose_exchange(n, bits, B, 64, per_node=4) == "node_two_phase"   # M = 16
    slow_inside = cost.NetworkModel(node_bandwidth=1e6)
    assert cost.choose_exchange(n, bits, B, 4, slow_inside, per_node=2) in cost.FLAT_MODES
    with pytest.raises(ValueError, match=TOPOLOGY_ENV):
        cost.resolve_exchange("node_two_phase", n, bits, B, 4)
    assert choice.allowed_modes(4, per_node=2) == ("allgather", "two_phase", "node_allgather")
    assert choice.allowed_modes(64, per_node=8) == ("two_phase", "node_allgather",
                                                    "node_two_phase")
    assert len(choice.candidates(4, per_node=2)) == 6
    assert choice.allowed_modes(4, "node_two_phase", per_node=2) == ("node_two_phase",)


# ================================================================ checks (inside the ranks)
def _make(torch, hvd, exchange, *, method="qsgd", bits=3, wire="fixed", **kw):
    import horovod_aq
    import horovod_aq.torch as aqt

    model = tiny_model(torch, 0)
    comp = horovod_aq.compressors.from_name(method, bits=bits, bucket_size=BUCKET, seed=7,
                                            schedule="0", **kw)
    opt = aqt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=comp, exchange=exchange, wire=wire, fusion_bytes=FUSION_BYTES,
        stall_timeout_s=120)
    return model, comp, opt


def _batch(torch, rank, step=0, n=8):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 20, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _params(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def node_oracle(exchange: str, wire: str = "fixed"):
    """One exchange; what every payload encoded (the engine's tap), the local gradient and the
    result."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    model, comp, opt = _make(torch, hvd, exchange, wire=wire)
    entries = []
    opt.wire.tap = lambda bucket, part, values, payload: entries.append(
        (bucket.name, part, values.detach().numpy().copy(), payload.detach().numpy().copy()))
    x, y = _batch(torch, hvd.rank())
    F.cross_entropy(model(x), y).backward()
    ref = tiny_model(torch, 0)
    F.cross_entropy(ref(x), y).backward()
    opt.synchronize()
    return {"entries": entries, "buckets": opt.buckets, "modes": [m for _, _, m, _ in opt.buckets],
            "local": {n: p.grad.numpy().copy() for n, p in ref.named_parameters()},
            "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()},
            "levels": comp.table.levels, "version": comp.table.version,
            "telemetry": opt.telemetry.last.as_dict()}


def node_training(exchange: str = "node_two_phase", steps: int = 40):
    """ALQ(bits=3) with its defaults (error feedback, table refits) against Horovod's fp32
    optimizer in the same ranks, on a task the model can learn."""
    torch, hvd = init_torch()
    import horovod.torch as hvd_torch
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    teacher = torch.randn(20, 10, generator=torch.Generator().manual_seed(3))

    def data(step):
        gen = torch.Generator().manual_seed(10_000 + 100 * step + hvd.rank())
        x = torch.randn(16, 20, generator=gen)
        return x, (x @ teacher).argmax(1)

    out = {}
    for label in ("fp32", exchange):
        model = tiny_model(torch, 0)
        base = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if label == "fp32":
            opt = hvd_torch.DistributedOptimizer(base, named_parameters=model.named_parameters())
        else:
            comp = horovod_aq.ALQ(bits=3)
            opt = aqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=comp, exchange=exchange,
                                           fusion_bytes=FUSION_BYTES)
        losses = []
        for step in range(steps):
            x, y = data(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        x, y = data(10_000)
        accuracy = float((model(x).argmax(1) == y).float().mean())
        out[label] = {"losses": losses, "accuracy": accuracy, "params": _params(model)}
        if label != "fp32":
            last = opt.telemetry.last
            out[label].update(memory=sorted(opt.compression.error_memory.memory),
                              version=comp.table.version, exchanges=dict(last.exchanges),
                              bytes_sent=last.bytes_sent, modes=[m for _, _, m, _ in
                                                                 opt.buckets])
    return out


def node_nonfinite(nonfinite: str, exchange: str = "node_two_phase"):
    """Rank 1's gradient of the first layer's bias (a bucket whose second shard is empty) has
    a NaN in step 1; rank 2's first-layer weight an Inf in step 2, in its second shard."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    model, comp, opt = _make(torch, hvd, exchange, nonfinite=nonfinite)
    named = dict(model.named_parameters())
    poison = {(1, 1): ("0.bias", 3, float("nan")), (2, 2): ("0.weight", 1000, float("inf"))}
    outcomes, before_after = [], []
    for step in range(4):
        hook = None
        if (step, hvd.rank()) in poison:
            name, i, value = poison[(step, hvd.rank())]

            def bad(g, i=i, value=value):
                g = g.clone()
                g.view(-1)[i] = value
                return g
            hook = named[name].register_hook(bad)
        before = _params(model)
        x, y = _batch(torch, hvd.rank(), step=step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        try:
            opt.step()
            outcomes.append(("ok", ""))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcomes.append((type(exc).__name__, str(exc)))
        if hook is not None:
            hook.remove()
        before_after.append(all(np.array_equal(before[n], v)
                                for n, v in _params(model).items()))
    return {"outcomes": outcomes, "unchanged": before_after, "params": _params(model),
            "skipped": [r.extra.get("skipped", 0.0) for r in opt.telemetry.history]}


def node_auto():
    """wire="auto" on a topology: the trials include the node-aware modes, and every rank
    installs the same decision."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    from horovod_aq.packed.autowire import AutoWire

    model, comp, opt = _make(torch, hvd, "auto", wire=AutoWire(warmup_steps=1, trials=1))
    candidates = [f"{c.coding}/{c.mode}" for c in opt.autowire.candidates]
    for step in range(opt.autowire.measure_steps + 3):
        x, y = _batch(torch, hvd.rank(), step=step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    d = opt.autowire.decision
    return {"candidates": candidates, "decided": None if d is None else bool(d.decided),
            "choices": None if d is None else [(c.coding, c.mode) for c in d.choices],
            "params": _params(model)}


def node_oracle_allgather():
    return node_oracle("node_allgather")


def node_oracle_two_phase():
    return node_oracle("node_two_phase")


def node_oracle_entropy():
    return node_oracle("node_two_phase", wire="entropy")


def node_raise():
    return node_nonfinite("raise")


def node_raise_allgather():
    return node_nonfinite("raise", exchange="node_allgather")


def node_skip():
    return node_nonfinite("skip")


CHECKS = [node_oracle_allgather, node_oracle_two_phase, node_oracle_entropy, node_training,
          node_raise, node_raise_allgather, node_skip, node_auto]
#: (controller, ranks) -> the checks that launch runs (tests/launches.py)
LAUNCHES = {"launch": {("gloo", 4): CHECKS, ("mpi", 4): CHECKS}}


@pytest.fixture(scope="module", params=launches.params(LAUNCHES["launch"], slow=[("mpi", 4)]),
                ids=lambda p: f"{p[0]}-{p[1]}")
def launch(request):
    controller, ranks = request.param
    return run_local(LAUNCHES["launch"][request.param], np=ranks, controller=controller,
                     timeout=600, env={TOPOLOGY_ENV: f"{NODES}x{PER_NODE}"})


def _get(launch, check):
    launches.read(check)
    return launch.get(check)


# ================================================================ the oracle (in pytest)
def _shard_mean(results, node, local, lo, n, params):
    """float32 (g_a + g_b + …) / L of the node's ranks, in local-rank order (stage A)."""
    rows = [np.concatenate([results[node * PER_NODE + k]["local"][p].ravel() for p in params])
            for k in range(PER_NODE)]
    total = rows[0][lo:lo + n].copy()
    for row in rows[1:]:
        total += row[lo:lo + n]
    return total / np.float32(PER_NODE)


def _expected_bucket(results, name, numel, mode, params, table):
    """The bucket every rank must hold, from what the ranks encoded (their tapped payloads)."""
    shards = []
    for local in range(PER_NODE):
        lo, n = cost.shard_span(numel, PER_NODE, BUCKET, local)
        if n == 0:
            continue
        ranks = [node * PER_NODE + local for node in range(NODES)]    # the cross peers
        taps = {r: [e for e in results[r]["entries"] if e[0] == name] for r in ranks}
        for node, r in enumerate(ranks):   # each encoded its node's exact float32 average
            np.testing.assert_array_equal(
                taps[r][0][2][:n] if mode == "node_allgather" else
                np.concatenate([e[2] for e in taps[r][:NODES]])[:n],
                _shard_mean(results, node, local, lo, n, params))
        if mode == "node_allgather":
            shards.append(codec.decode_average(np.stack([taps[r][0][3] for r in ranks]), table))
            continue
        m = cost.chunk_numel(n, NODES, BUCKET)
        decoded = []
        for i, r in enumerate(ranks):      # peer i averages chunk i, re-encodes it (part M)
            avg = codec.decode_average(np.stack([taps[q][i][3] for q in ranks]), table)
            avg[max(n - i * m, 0):] = 0
            reencoded = taps[r][NODES]
            assert reencoded[1] == NODES
            np.testing.assert_array_equal(reencoded[2], avg)
            decoded.append(codec.decode(reencoded[3], table))
        shards.append(np.concatenate(decoded)[:n])
    return np.concatenate(shards)


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", [node_oracle_allgather, node_oracle_two_phase,
                                   node_oracle_entropy], ids=lambda c: c.__name__)
def test_every_rank_holds_the_oracles_node_aware_average(launch, check):
    results = _get(launch, check)
    table = LevelTable(results[0]["levels"], results[0]["version"])
    modes = {r["buckets"][0][2] for r in results}
    assert len(modes) == 1 and modes <= set(cost.NODE_MODES)
    buckets = results[0]["buckets"]
    assert len(buckets) >= 2
    uneven = [b for b in buckets if cost.shard_span(b[1], PER_NODE, BUCKET, 1)[1] == 0]
    assert uneven, "the test model should have a bucket whose second shard is empty"
    for name, numel, mode, params in buckets:
        expected = _expected_bucket(results, name, numel, mode, params, table)
        for r in results:
            got = np.concatenate([r["grads"][p].ravel() for p in params])
            np.testing.assert_array_equal(got, expected, err_msg=f"{check} {name}")


@pytest.mark.multiprocess
@pytest.mark.reads("node_oracle_two_phase")
def test_telemetry_counts_what_leaves_the_node_and_what_stays(launch):
    results = _get(launch, node_oracle_two_phase)
    n = sum(b[1] for b in results[0]["buckets"])
    tele = results[0]["telemetry"]
    inside = sum(2 * 4 * (b[1] - cost.shard_span(b[1], PER_NODE, BUCKET, 0)[1])
                 for b in results[0]["buckets"])
    assert tele["bytes_sent"] > inside > 0
    assert tele["exchanges"] == {"node_two_phase": len(results[0]["buckets"])}
    assert tele["numel_quantized"] == n


@pytest.mark.multiprocess
def test_node_aware_training_keeps_fp32_accuracy_and_identical_replicas(launch):
    results = _get(launch, node_training)
    for label in ("fp32", "node_two_phase"):
        for r in results[1:]:
            for name, p in r[label]["params"].items():
                np.testing.assert_array_equal(p, results[0][label]["params"][name])
    node, fp32 = results[0]["node_two_phase"], results[0]["fp32"]
    assert node["accuracy"] >= fp32["accuracy"] - 0.08, (node["accuracy"], fp32["accuracy"])
    assert np.mean(node["losses"][-5:]) < 0.6 * np.mean(node["losses"][:5])
    assert node["version"] >= 1, "ALQ never fitted its table to the node-averaged shards"
    assert set(node["modes"]) == {"node_two_phase"}
    for rank, r in enumerate(results):   # each rank's error memory is its shard's
        keys = r["node_two_phase"]["memory"]
        assert keys and all(k.endswith(f".{NODES}x{PER_NODE}.s{rank % PER_NODE}") for k in keys)


@pytest.mark.multiprocess
@pytest.mark.reads("node_raise", "node_raise_allgather")
def test_a_nonfinite_gradient_raises_the_same_error_on_every_rank(launch):
    for check in (node_raise, node_raise_allgather):
        results = _get(launch, check)
        for step, who in ((1, "0–1 (node 0"), (2, "2–3 (node 1")):
            outcomes = {r["outcomes"][step] for r in results}
            assert len(outcomes) == 1, (check, step, outcomes)
            kind, message = outcomes.pop()
            assert kind == "NonFiniteGradientError" and who in message, (check, message)
        assert "'0.bias'" in results[0]["outcomes"][1][1]
        assert "'0.weight'" in results[0]["outcomes"][2][1]
        assert all(r["outcomes"][0] == r["outcomes"][3] == ("ok", "") for r in results)


@pytest.mark.multiprocess
@pytest.mark.reads("node_skip")
def test_a_nonfinite_gradient_skips_the_step_on_every_rank(launch):
    results = _get(launch, node_skip)
    for r in results:
        assert [o[0] for o in r["outcomes"]] == ["ok"] * 4
        assert r["unchanged"] == [False, True, True, False]
        assert r["skipped"] == [0.0, 1.0, 1.0, 0.0]
        assert all(np.isfinite(p).all() for p in r["params"].values())
        for name, p in r["params"].items():
            np.testing.assert_array_equal(p, results[0]["params"][name])


@pytest.mark.multiprocess
def test_auto_measures_the_node_aware_modes_and_agrees(launch):
    results = _get(launch, node_auto)
    first = results[0]
    assert {c.split("/")[1] for c in first["candidates"]} == {"allgather", "two_phase",
                                                              "node_allgather"}
    assert first["decided"] is True
    assert all(r["choices"] == first["choices"] for r in results)
    for r in results[1:]:
        for name, p in r["params"].items():
            np.testing.assert_array_equal(p, first["params"][name])
    assert math.isfinite(sum(float(np.abs(p).sum()) for p in first["params"].values()))
