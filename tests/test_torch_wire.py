"""The torch wire engine (horovod_aq.torch.wire) on P simulated ranks in one process: a loopback
collective adapter delivers what every rank's Wire submitted, so the engine's stages, markers,
presence masks, stall deadline and joined-rank check are checked against the numpy oracle
without launching ranks (the launches are tests/test_torch_optimizer.py and tests/test_ddp.py)."""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed.cost import chunk_numel
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.receive import JoinedRankError
from horovod_aq.packed.waiting import Deadline, ExchangeStalledError

# Triton's interpreter encodes an unsendable bucket as it would on a GPU (the wire then sends
# markers in its place, decided on the device): numpy warns about its arithmetic
pytestmark = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value) encountered:RuntimeWarning")

torch = pytest.importorskip("torch")
wire_mod = pytest.importorskip("horovod_aq.torch.wire")
compensated = pytest.importorskip("horovod_aq.torch.compensated")
kernels_mod = pytest.importorskip("horovod_aq.torch.kernels")

B = 16
SEED = 5


class Network:
    """What P ranks submitted, by collective name (one process, ranks driven in turn)."""

    def __init__(self, ranks: int, zero_fills_joined: bool = False) -> None:
        self.ranks, self.zero_fills_joined = ranks, zero_fills_joined
        self.sent: dict[str, dict[int, list[torch.Tensor]]] = {}


class _Pending:
    def __init__(self, net, name, rank, collect):
        self.net, self.name, self.rank, self.collect = net, name, rank, collect

    def done(self):
        return len(self.net.sent.get(self.name, {})) == self.net.ranks

    def wait(self):
        return self.collect(self.net.sent[self.name])


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """What a collective delivers: the ranks' tensors, concatenated (the loopback's only device
    work, which a test counting the wire's own can leave out)."""
    return torch.cat(tensors)


class Loopback:
    """The :class:`~horovod_aq.torch.wire.Collectives` of one simulated rank."""

    def __init__(self, net: Network, rank: int) -> None:
        self.net, self.rank, self.size = net, rank, net.ranks
        self.zero_fills_joined = net.zero_fills_joined

    def _put(self, name, payloads):
        self.net.sent.setdefault(name, {})[self.rank] = payloads

    def allgather(self, payload, name, then, *, delimit=None):
        self._put(name, [payload])

        def collect(sent):
            flat = _concat([sent[r][0] for r in range(self.size)])
            if delimit is None:   # equal sizes, as every fixed-coding collective assumes
                return then(wire_mod.Received(flat, [payload.numel()] * self.size))
            # what Horovod's allgather does: only the concatenation arrives
            host = flat.numpy().copy()   # as Horovod's adapter: the copy that delimits
            return then(wire_mod.Received(flat, delimit(host, self.size), host))
        return _Pending(self.net, name, self.rank, collect)

    def alltoall(self, payloads, name, *, variable=False):
        self._put(name, list(payloads))

        def collect(sent):
            mine = [sent[r][self.rank] for r in range(self.size)]
            return wire_mod.Received(_concat(mine), [p.numel() for p in mine])
        return _Pending(self.net, name, self.rank, collect)


NAMES, NUMELS = ("w", "b", "v"), (40, 7, 23)


@pytest.fixture(params=["auto", "ops", "triton"])
def kernels(request, monkeypatch):
    """An engine test with CPU's fused kernels, with the torch ops that run on a device, and
    with the Triton kernels (in Triton's interpreter without a GPU; conftest.py): the device
    ones decide plain rows by a device flag (docs/protocol.md §5.8)."""
    if request.param == "triton":
        from horovod_aq.torch import triton_kernels

        if not (triton_kernels.available() and triton_kernels.interpreting()):
            pytest.skip("Triton's interpreter runs the kernels on CPU tensors")
        monkeypatch.setattr(kernels_mod, "implementation_for", lambda device: "triton")
    else:
        monkeypatch.setattr(kernels_mod, "IMPLEMENTATION", request.param)
    return request.param


@pytest.fixture(params=[False, True], ids=["at-once", "deferred"])
def defer(request):
    """A wire that decides its final rows at once, and one that leaves their device flag for
    ``Wire.settle`` (the optimizer's and the DDP hook's: docs/protocol.md §5.8)."""
    return request.param


#: A bucket large enough that entropy-coded payloads are smaller than fixed-width ones.
BIG = (4000, 7, 2993)


def _ranks(P, mode, comp_factory, *, masked=False, net=None, deadline=Deadline(None),
           coding="fixed", numels=NUMELS, defer=False):
    net = net or Network(P)
    n = sum(numels)
    plan = BucketPlan(3, "t.0.abc", (0, 1, 2), n, mode)
    out = []
    for r in range(P):
        comp = comp_factory()
        wire = wire_mod.Wire(comp, Loopback(net, r), stream_rank=r, deadline=deadline,
                             defer=defer)
        out.append((comp, wire, wire_mod.Bucket(plan, NAMES, numels, masked=masked,
                                                coding=coding)))
    return net, out


def _grads(P, seed=0, numels=NUMELS):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(sum(numels)).astype(np.float32) for _ in range(P)]


def _result(wire, bucket):
    """The bucket's result as the optimizer and the DDP hook take it: finished, then settled
    (raising what settling found)."""
    wire.finish(bucket)
    for _, exc in wire.settle([bucket]):
        raise exc
    return bucket.result


def _run(ranks, grads, present=None):
    for (comp, wire, bucket), g in zip(ranks, grads):
        wire.submit(bucket, torch.from_numpy(g.copy()), present)
    for comp, wire, bucket in ranks:
        wire.advance(bucket)
    return [_result(wire, bucket).numpy() for comp, wire, bucket in ranks]


def _qsgd():
    return horovod_aq.QSGD(bits=3, bucket_size=B, seed=SEED)


def _oracle(grads, mode, table):
    P, n = len(grads), grads[0].size

    def enc(x, rank, part):
        return codec.encode(x, table, bucket_size=B, norm="l2",
                            key=StreamKey(SEED, rank, 0, 3, part))
    if mode == "allgather":
        return codec.decode_average(np.stack([enc(g, r, 0) for r, g in enumerate(grads)]), table)
    m = chunk_numel(n, P, B)
    padded = [np.concatenate([g, np.zeros(P * m - n, np.float32)]) for g in grads]
    chunks = []
    for r in range(P):
        avg = codec.decode_average(np.stack([enc(padded[p][r * m:(r + 1) * m], p, r)
                                             for p in range(P)]), table)
        avg[min(max(n - r * m, 0), m):] = 0.0
        chunks.append(codec.decode(enc(avg, r, P), table))
    return np.concatenate(chunks)[:n]


@pytest.mark.parametrize("mode, P", [("allgather", 2), ("allgather", 3), ("two_phase", 3),
                                     ("two_phase", 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_engine_equals_the_numpy_oracle_and_taps_every_payload(kernels, defer, mode, P,
                                                                   masked):
    _, ranks = _ranks(P, mode, _qsgd, masked=masked, defer=defer)
    tapped = []
    for comp, wire, bucket in ranks:
        wire.tap = lambda b, part, values, payload, r=wire.stream_rank: tapped.append((r, part))
    grads = _grads(P)
    results = _run(ranks, grads)
    expected = _oracle(grads, mode, ranks[0][0].table)
    for got in results:
        np.testing.assert_array_equal(got, expected)
    parts = [0] if mode == "allgather" else list(range(P + 1))
    assert sorted(tapped) == sorted((r, k) for r in range(P) for k in parts)
    assert all(wire.seconds["encode"] > 0 for _, wire, _ in ranks)


def test_error_feedback_memory_is_what_the_rank_did_not_send():
    P = 2
    _, ranks = _ranks(P, "two_phase", lambda: horovod_aq.ErrorFeedback(_qsgd(), alpha=1.0,
                                                                       beta=1.0))
    grads = _grads(P)
    sent = {}
    for comp, wire, bucket in ranks:
        wire.tap = (lambda b, part, values, payload, r=wire.stream_rank:
                    sent.setdefault(r, []).append((part, payload.clone())))
    _run(ranks, grads)
    table = ranks[0][0].quantizer.table
    for r, (comp, wire, bucket) in enumerate(ranks):
        first = [p for part, p in sorted(sent[r], key=lambda e: e[0]) if part < P]
        g_hat = np.concatenate([codec.decode(p.numpy(), table) for p in first])[:bucket.numel]
        np.testing.assert_allclose(comp.error_memory.memory[bucket.name].numpy(),
                                   grads[r] - g_hat, rtol=0, atol=1e-6)


def _marker_errors(ranks, grads):
    """Every rank submits its gradient and advances (two-phase: a wire that decides at once
    raises there); the NonFiniteGradientError message each one meets."""
    errors = {}
    for (comp, wire, bucket), g in zip(ranks, grads):
        wire.submit(bucket, torch.from_numpy(g))
    for r, (comp, wire, bucket) in enumerate(ranks):
        try:
            wire.advance(bucket)
        except codec.NonFiniteGradientError as exc:
            errors[r] = str(exc)
    for r, (comp, wire, bucket) in enumerate(ranks):
        if r not in errors:
            with pytest.raises(codec.NonFiniteGradientError) as err:
                _result(wire, bucket)
            errors[r] = str(err.value)
    return [errors[r] for r in range(len(ranks))]


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_a_marker_names_rank_and_parameter_on_every_rank(kernels, defer, mode):
    P = 3
    _, ranks = _ranks(P, mode, _qsgd, defer=defer)
    grads = _grads(P)
    grads[2][45] = np.nan                     # parameter "b" occupies elements 40..46
    errors = _marker_errors(ranks, grads)
    assert len(set(errors)) == 1 and "on rank 2" in errors[0] and "'b'" in errors[0]


@pytest.mark.parametrize("kernels", ["ops", "triton"], indirect=True)
@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_a_deferred_wire_decides_its_rows_when_settled(kernels, mode):
    """With ``defer`` finish reads no flag: a marker (decoded on the device as if plain: in the
    allgather, or in two-phase's alltoall, whose chunk then goes out as a marker) is found by
    ``settle``, which returns its error beside the bucket, once."""
    P = 2
    _, ranks = _ranks(P, mode, _qsgd, defer=True)
    grads = _grads(P)
    grads[1][3] = np.inf
    for (comp, wire, bucket), g in zip(ranks, grads):
        wire.submit(bucket, torch.from_numpy(g))
    for comp, wire, bucket in ranks:
        wire.advance(bucket)
    for comp, wire, bucket in ranks:
        wire.finish(bucket)                    # no error yet: the flags are unread
        assert (bucket.unsettled if mode == "allgather" else bucket.unsettled_chunks) is not None
        [(failed, exc)] = wire.settle([bucket])
        assert failed is bucket and isinstance(exc, codec.NonFiniteGradientError)
        assert "on rank 1" in str(exc) and "'w'" in str(exc)
        assert bucket.unsettled is None and bucket.unsettled_chunks is None
        assert wire.settle([bucket]) == []


@pytest.mark.parametrize("kernels", ["ops"], indirect=True)
def test_a_bad_chunk_found_when_settled_stops_every_rank(kernels):
    """Two-phase with ``defer``: a payload only rank 0 receives is bad (a NaN norm).
    Rank 0 sends a marker instead of its averaged chunk, so it raises the payload's error and
    rank 1 the marker's, naming rank 0: no rank goes on with a chunk nobody checked."""
    P = 2
    net, ranks = _ranks(P, "two_phase", _qsgd, defer=True)
    for (comp, wire, bucket), g in zip(ranks, _grads(P)):
        wire.submit(bucket, torch.from_numpy(g))
    to_rank0 = net.sent["aq.a2a.t.0.abc"][1][0]
    to_rank0[codec.HEADER_SIZE:codec.HEADER_SIZE + 4] = torch.tensor([255, 255, 255, 127])
    for comp, wire, bucket in ranks:
        wire.advance(bucket)
    errors = []
    for comp, wire, bucket in ranks:
        wire.finish(bucket)
        [(_, exc)] = wire.settle([bucket])
        errors.append(exc)
    assert isinstance(errors[0], codec.PayloadError), errors[0]
    assert isinstance(errors[1], codec.NonFiniteGradientError) and "on rank 0" in str(errors[1])


@pytest.mark.parametrize("kernels", ["auto", "triton"], indirect=True)
def test_a_bad_entropy_coded_chunk_raises_its_payload_error(kernels, defer):
    # an entropy-coded row only rank 0 receives has a NaN norm: with Triton its flag is read
    # with the re-encode's histograms (entropy.entropy_of_parts), and the rows then take the
    # checked path, which raises the payload's error as at once
    P = 2
    net, ranks = _ranks(P, "two_phase", _qsgd, coding="entropy", numels=BIG, defer=defer)
    for (comp, wire, bucket), g in zip(ranks, _grads(P, numels=BIG)):
        wire.submit(bucket, torch.from_numpy(g))
    [alltoall] = [key for key in net.sent if key.startswith("aq.a2a")]
    to_rank0 = net.sent[alltoall][1][0]       # from rank 1
    assert to_rank0[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY
    to_rank0[codec.HEADER_SIZE:codec.HEADER_SIZE + 4] = torch.tensor([255, 255, 255, 127])
    comp, wire, bucket = ranks[0]
    with pytest.raises(codec.PayloadError):
        wire.advance(bucket)


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_an_average_past_float32_is_a_marker_for_every_rank(kernels, defer, nonfinite):
    """Two-phase: both ranks' first bucket fits a float32 norm, the re-encoded average of
    chunk 0 does not (8e37 · √16 sendable, its quantized average not): rank 0 sends a marker
    in the second allgather, so both ranks raise naming parameter 'w' (or both skip), where
    rank 0 alone had raised and rank 1 waited for its allgather."""
    _, ranks = _ranks(2, "two_phase", lambda: horovod_aq.QSGD(bits=3, bucket_size=B, seed=SEED,
                                                              nonfinite=nonfinite), defer=defer)
    grads = _grads(2)
    for g in grads:
        g[:16] = 8e37
    if nonfinite == "skip":
        assert all(np.isnan(r).all() for r in _run(ranks, grads))
        return
    for (comp, wire, bucket), g in zip(ranks, grads):
        wire.submit(bucket, torch.from_numpy(g))
    for comp, wire, bucket in ranks:
        wire.advance(bucket)   # rank 0's chunk average overflows: it sends a marker
    errors = []
    for comp, wire, bucket in ranks:
        with pytest.raises(codec.NonFiniteGradientError) as err:
            _result(wire, bucket)
        errors.append(str(err.value))
    assert len(set(errors)) == 1 and "on rank 0" in errors[0] and "'w'" in errors[0]


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_skip_gives_nan_on_every_rank(kernels, defer, mode):
    P = 2
    _, ranks = _ranks(P, mode,
                      lambda: horovod_aq.QSGD(bits=3, bucket_size=B, seed=SEED, nonfinite="skip"),
                      defer=defer)
    grads = _grads(P)
    grads[0][:] = 3e38                        # finite, but the bucket norms overflow float32
    results = _run(ranks, grads)
    assert all(np.isnan(r).all() for r in results)
    assert all(bucket.skipped for _, _, bucket in ranks)


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_presence_masks_zero_what_no_rank_had(kernels, defer, mode):
    P = 3
    _, ranks = _ranks(P, mode, _qsgd, masked=True, defer=defer)
    grads = _grads(P)
    for g in grads:
        g[40:47] = 0.0                          # "b" absent everywhere, sent as zeros
    results = _run(ranks, grads, present=[True, False, True])
    for (_, _, bucket), got in zip(ranks, results):
        assert bucket.gone == [1]
        assert not got[40:47].any()
        np.testing.assert_array_equal(got, results[0])


@pytest.mark.parametrize("mode, P", [("allgather", 3), ("two_phase", 3), ("two_phase", 2)])
def test_a_settling_wire_decides_presence_masks_as_at_once(kernels, mode, P):
    # "b" absent on one rank, then on every rank: a wire that settles keeps the masks' union on
    # the device (two-phase zeroes the re-encoded chunk's absent parameters there) and reads it
    # at settle, with the same results and absent parameters as a wire that decides at once
    grads = _grads(P)
    for absent_on in ([1], list(range(P))):
        got = {}
        for defer in (False, True):
            _, ranks = _ranks(P, mode, _qsgd, masked=True, defer=defer)
            for r, ((_, wire, bucket), g) in enumerate(zip(ranks, grads)):
                present = [True, r not in absent_on, True]
                x = g.copy()
                x[40:47] = x[40:47] if present[1] else 0.0
                wire.submit(bucket, torch.from_numpy(x), present)
            for _, wire, bucket in ranks:
                wire.advance(bucket)
            got[defer] = [(_result(wire, bucket).numpy(), bucket.gone) for _, wire, bucket in ranks]
        for (at_once, gone), (settled, settled_gone) in zip(got[False], got[True]):
            np.testing.assert_array_equal(settled, at_once)
            assert settled_gone == gone == ([1] if len(absent_on) == P else [])
            assert not settled[40:47].any() or len(absent_on) < P


def test_a_steps_presence_masks_are_copied_to_the_device_once():
    # a host-to-device copy every step would wait for the device's stream (a host
    # synchronisation per bucket on a GPU): equal masks come from the cache, others do not
    from horovod_aq.torch.payload import device_constant

    _, [(_, wire, bucket)] = _ranks(1, "allgather", _qsgd, masked=True)
    first = wire.presence_mask(bucket, [True, False, True], torch.device("cpu"))
    assert wire.presence_mask(bucket, [True, False, True], torch.device("cpu")) is first
    assert first.tolist() == [0b10100000]
    other = wire.presence_mask(bucket, None, torch.device("cpu"))
    assert other is not first and other.tolist() == [0b11100000]
    counts = device_constant(np.array([3, 4]), "cpu")
    assert device_constant(np.array([3, 4]), "cpu") is counts
    assert device_constant(np.array([3, 4], np.int32), "cpu") is not counts


def test_a_stalled_wait_ends_with_an_error_naming_the_collective():
    _, ranks = _ranks(2, "allgather", _qsgd, deadline=Deadline(0.05, step=lambda: 7))
    comp, wire, bucket = ranks[0]
    wire.submit(bucket, torch.from_numpy(_grads(2)[0]))   # rank 1 never submits
    with pytest.raises(ExchangeStalledError) as err:
        wire.finish(bucket)
    assert "'aq.ag.t.0.abc'" in str(err.value) and "at step 7" in str(err.value)


def test_a_zero_filled_row_is_a_joined_rank(kernels, defer):
    net = Network(2, zero_fills_joined=True)
    _, ranks = _ranks(2, "allgather", _qsgd, net=net, defer=defer)
    comp, wire, bucket = ranks[0]
    wire.submit(bucket, torch.from_numpy(_grads(2)[0]))
    mine = net.sent["aq.ag.t.0.abc"][0][0]
    net.sent["aq.ag.t.0.abc"][1] = [torch.zeros_like(mine)]   # what Horovod sends for rank 1
    with pytest.raises(JoinedRankError, match=r"rank\(s\) 1 called hvd.join\(\)"):
        _result(wire, bucket)


# ---------------------------------------------------------------- the entropy-coded wire
def _tap_all(ranks):
    tapped = {}
    for comp, wire, bucket in ranks:
        wire.tap = (lambda b, part, values, payload, r=wire.stream_rank:
                    tapped.setdefault((r, part), (values.clone(), payload.clone())))
    return tapped


ENTROPY_CASES = [("allgather", 2, False), ("allgather", 3, True), ("two_phase", 3, False),
                 ("two_phase", 2, True)]


# (Triton's interpreter is slow: its cases decode both two-phase stages on the device, the
# final rows' flag read at once and at the settle)
@pytest.mark.parametrize("kernels, mode, P, masked, settles", [
    *[(k, *case, False) for k in ("auto", "ops") for case in ENTROPY_CASES],
    *[("triton", "two_phase", 2, True, settles) for settles in (False, True)]],
    indirect=["kernels"])
def test_the_entropy_wire_sends_the_oracles_bytes_and_averages_like_the_fixed_one(
        kernels, mode, P, masked, settles):
    _, ranks = _ranks(P, mode, _qsgd, coding="entropy", numels=BIG, masked=masked,
                      defer=settles)
    tapped = _tap_all(ranks)
    grads = _grads(P, numels=BIG)
    results = _run(ranks, grads)
    table = ranks[0][0].table
    flagged = 0
    for (r, part), (values, payload) in tapped.items():
        want = codec.encode_entropy(values.numpy(), table, bucket_size=B, norm="l2",
                                    key=StreamKey(SEED, r, 0, 3, part))
        np.testing.assert_array_equal(payload.numpy(), want)
        assert payload.numel() <= codec.payload_size(values.numel(), table.bits, B)
        flagged += bool(want[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY)
    assert flagged == len(tapped)        # every payload of this bucket is entropy-coded
    # the same codes as the fixed wire: the same average, bitwise
    expected = _oracle(grads, mode, table)
    for got in results:
        np.testing.assert_array_equal(got, expected)
    if mode == "allgather":   # and the average is codec.decode_average of the gathered rows
        rows = [tapped[(r, 0)][1].numpy() for r in range(P)]
        np.testing.assert_array_equal(results[0], codec.decode_average(rows, table))
    sizes = {payload.numel() for _, payload in tapped.values()}
    assert len(sizes) > 1                # the payloads really have different lengths


def test_two_phase_chunks_are_the_oracles_payloads_of_the_padded_chunks(kernels):
    # P = 3 chunks of m = 32 over 70 coordinates: the last one holds 6 (with Triton the one-pass
    # encode pads it itself, with no padded copy of x); every first-phase payload is
    # codec.encode of the chunk padded with zeros to m, which is what the tap sees
    P = 3
    _, ranks = _ranks(P, "two_phase", _qsgd)
    tapped = _tap_all(ranks)
    grads = _grads(P)
    _run(ranks, grads)
    table, m = ranks[0][0].table, chunk_numel(sum(NUMELS), P, B)
    for r, g in enumerate(grads):
        padded = np.concatenate([g, np.zeros(P * m - g.size, np.float32)]).reshape(P, m)
        for k in range(P):
            values, payload = tapped[(r, k)]
            np.testing.assert_array_equal(values.numpy(), padded[k])
            np.testing.assert_array_equal(payload.numpy(), codec.encode(
                padded[k], table, bucket_size=B, key=StreamKey(SEED, r, 0, 3, k)))


def test_the_entropy_wire_counts_the_bytes_it_sends():
    P = 3
    sent = {}
    for coding in ("fixed", "entropy"):
        _, ranks = _ranks(P, "two_phase", _qsgd, coding=coding, numels=BIG)
        tapped = _tap_all(ranks)
        _run(ranks, _grads(P, numels=BIG))
        wire = ranks[1][1]
        mine = {part: p.numel() for (r, part), (_, p) in tapped.items() if r == 1}
        counts = wire.take_sent()
        assert counts["payload_bytes"] == sum(mine[k] for k in range(P))
        assert counts["bytes_sent"] == (sum(mine[k] for k in range(P) if k != 1)
                                        + (P - 1) * mine[P])
        assert wire.take_sent() == {"payload_bytes": 0, "bytes_sent": 0, "node_bytes": 0}
        sent[coding] = counts
    assert sent["entropy"]["bytes_sent"] < 0.9 * sent["fixed"]["bytes_sent"]


@pytest.mark.parametrize("kernels", ["triton"], indirect=True)
def test_a_settling_wire_leaves_entropy_coded_rows_flag_on_the_device(kernels):
    # with Triton, entropy-coded rows are decoded on the device (one copy of their headers and
    # models) and, on a wire that settles, their flag and the masks' union wait for the
    # settle: no item() while the allgather's rows are decoded (each decode read its flag
    # before); the same results and absent parameter as a wire that decides at once
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket.__name__ == "_local_scalar_dense":
                reads.append(func)
            return func(*args, **(kwargs or {}))

    P, grads = 2, _grads(2, numels=BIG)
    got = {}
    for settles in (False, True):
        _, ranks = _ranks(P, "allgather", _qsgd, coding="entropy", numels=BIG, masked=True,
                          defer=settles)
        for (_, wire, bucket), g in zip(ranks, grads):
            wire.submit(bucket, torch.from_numpy(g.copy()), [True, False, True])
        reads.clear()
        with HostReads():
            for _, wire, bucket in ranks:
                wire.finish(bucket)
        assert (not reads) == settles   # at once, each rank reads its rows' flag
        got[settles] = [(_result(wire, bucket).numpy(), bucket.gone) for _, wire, bucket in ranks]
    for (at_once, gone), (settled, settled_gone) in zip(got[False], got[True]):
        np.testing.assert_array_equal(settled, at_once)
        assert settled_gone == gone == [1] and not settled[4000:4007].any()


def test_error_feedback_memory_on_the_entropy_wire():
    P = 2
    _, ranks = _ranks(P, "allgather", lambda: horovod_aq.ErrorFeedback(
        _qsgd(), alpha=1.0, beta=1.0), coding="entropy", numels=BIG)
    tapped = _tap_all(ranks)
    grads = _grads(P, numels=BIG)
    _run(ranks, grads)
    table = ranks[0][0].quantizer.table
    for r, (comp, wire, bucket) in enumerate(ranks):
        payload = tapped[(r, 0)][1].numpy()
        assert payload[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY
        np.testing.assert_allclose(comp.error_memory.memory[bucket.name].numpy(),
                                   grads[r] - codec.decode(payload, table), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernels", ["auto", "triton"], indirect=True)
@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_a_marker_among_entropy_payloads_names_rank_and_parameter(kernels, defer, mode):
    # with Triton the send is encoded first and chosen with the histograms' read
    # (entropy.entropy_of_parts): the marker names the same element as the host check
    P = 3
    _, ranks = _ranks(P, mode, _qsgd, coding="entropy", numels=BIG, masked=True, defer=defer)
    grads = _grads(P, numels=BIG)
    grads[1][4003] = np.inf                   # parameter "b" occupies elements 4000..4006
    errors = _marker_errors(ranks, grads)
    assert len(set(errors)) == 1 and "on rank 1" in errors[0] and "'b'" in errors[0]


@pytest.mark.parametrize("kernels", ["auto", "triton"], indirect=True)
def test_an_entropy_coded_average_past_float32_is_a_marker_for_every_rank(kernels, defer):
    # two-phase, entropy-coded: rank 0's re-encoded average of chunk 0 cannot travel (as in
    # test_an_average_past_float32_is_a_marker_for_every_rank), a marker of the chunk's size
    # naming element 0·m + j goes out instead, and both ranks raise naming parameter 'w'
    _, ranks = _ranks(2, "two_phase", _qsgd, coding="entropy", numels=BIG, defer=defer)
    grads = _grads(2, numels=BIG)
    for g in grads:
        g[:16] = 8e37
    for (comp, wire, bucket), g in zip(ranks, grads):
        wire.submit(bucket, torch.from_numpy(g))
    for comp, wire, bucket in ranks:
        wire.advance(bucket)
    errors = []
    for comp, wire, bucket in ranks:
        with pytest.raises(codec.NonFiniteGradientError) as err:
            _result(wire, bucket)
        errors.append(str(err.value))
    assert len(set(errors)) == 1 and "on rank 0" in errors[0] and "'w'" in errors[0], errors


def test_bucket_coding_is_checked():
    with pytest.raises(ValueError, match="coding must be one of"):
        wire_mod.Bucket(BucketPlan(0, "x", (0,), 4, "allgather"), ["w"], [4], coding="rans")


# ---------------------------------------------------------------- wire="auto"
def test_wire_setting_schedule_digest_decision_and_state():
    from horovod_aq.packed.autowire import AutoWire
    from horovod_aq.packed.wire_setting import WireSetting
    from horovod_aq.refit import LocalComm

    plans = [BucketPlan(0, "a", (0,), 4000, "allgather"), BucketPlan(1, "b", (1,), 3000,
                                                                     "allgather")]
    sent = {"bytes_sent": 100, "payload_bytes": 100}
    fixed = WireSetting("fixed", name="x")
    assert fixed.digest() == "fixed" and fixed.coding(5, 0) == "fixed"
    assert fixed.end_step(5, LocalComm(), plans, sent=sent) is None
    with pytest.raises(ValueError, match="wire must be one of"):
        WireSetting("rans", name="x")
    s = WireSetting(AutoWire("auto", warmup_steps=1, trials=1), name="ex.key")
    assert s.auto.name == "ex.key" and s.wire == "auto"
    # one rank: allgather only, so two candidates (fixed, entropy), one trial step each
    assert [s.coding(t, 0) for t in range(3)] == ["fixed", "fixed", "entropy"]
    assert [s.coding(t, 1) for t in range(3)] == ["fixed", "fixed", "entropy"]
    assert [s.mode(t, 1, "allgather") for t in range(3)] == ["allgather"] * 3
    undecided = s.digest()
    assert undecided == "auto(warmup=1,trials=1)"
    assert s.end_step(0, LocalComm(), plans, sent=sent) is None
    assert s.end_step(1, LocalComm(), plans, sent=sent) is None
    decision = s.end_step(2, LocalComm(), plans, sent=sent)
    assert decision is not None and decision.step == 3 and s.decision is decision
    assert s.digest() != undecided                  # the handshake compares the decision
    assert s.coding(3, 1) == "fixed" and s.coding(3, 7) == "fixed"   # unknown bucket: fixed
    assert s.mode(3, 7, "two_phase") == "two_phase"
    assert not s.modes_changed(plans)
    state = s.state_dict()
    again = WireSetting("auto", name="ex.key")
    again.load_state_dict(state, plans)
    assert again.decision == decision and again.coding(9, 0) == "fixed"
    other = WireSetting("auto", name="ex.key")   # a decision for other buckets is dropped
    other.load_state_dict(state, plans[:1])
    assert other.decision is None
    old = {**state, "decision": [1.0] + state["decision"][1:]}   # an older format: measure
    older = WireSetting("auto", name="ex.key")
    older.load_state_dict(old, plans)
    assert older.decision is None
    # the buckets changed after the decision: measure again from the next step
    assert s.end_step(4, LocalComm(), plans[:1], sent=sent) is None
    assert s.decision is None and s.auto.decision_step == 5 + 1 + 2


# ------------------------------------------------- error feedback fused into the CPU encoder
def _ef_steps(monkeypatch, fused, mode, P, coding, grads_of_step, *, factory=None,
              memory=None, defer=False, numels=BIG):
    """Run ``len(grads_of_step)`` steps of P ranks with error feedback, through the fused pass
    (``torch.compensated``) or the unfused steps; per step, every rank's result, memory (a
    copy), recorded statistics and tapped (part, values, payload)."""
    monkeypatch.setattr(compensated, "fusable", _FUSABLE if fused else lambda wire, raw: False)
    calls = []
    monkeypatch.setattr(compensated, "encode_compensated",
                        lambda *a: calls.append(1) or _ENCODE_COMPENSATED(*a))
    factory = factory or (lambda: horovod_aq.ErrorFeedback(
        horovod_aq.ALQ(bits=3, bucket_size=B, seed=SEED), alpha=0.5103, beta=0.9))
    _, ranks = _ranks(P, mode, factory, coding=coding, numels=numels, masked=True, defer=defer)
    steps = []
    for step, grads in enumerate(grads_of_step):
        net = Network(P)
        tapped = {}
        for r, (comp, wire, bucket) in enumerate(ranks):
            comp.step = step
            wire.comm.net = net
            bucket.reset()
            wire.tap = (lambda b, part, values, payload, r=r:
                        tapped.setdefault(r, []).append((part, values.clone(), payload.clone())))
            if memory is not None and step == 0:
                comp.error_memory.memory[bucket.name] = torch.from_numpy(memory[r].copy())
        recording = ranks[0][0].quantizer.recording
        results = _run(ranks, grads)
        mems = [comp.error_memory.memory.get(bucket.name) for comp, _, bucket in ranks]
        stats = [comp.quantizer._stats for comp, _, _ in ranks]
        for (comp, _, bucket), h in zip(ranks, mems):   # telemetry's ‖h‖ (fused: the kernel's)
            assert comp.error_memory.memory_norm() == pytest.approx(
                float(np.linalg.norm(h.numpy().astype(np.float64))), rel=1e-12, abs=0)
        steps.append({"results": results, "tapped": tapped, "recording": recording,
                      "memory": [None if h is None else h.numpy().copy() for h in mems],
                      "stats": [None if s is None else (s.norms, s.means, s.stds) for s in stats],
                      "sent": [wire.take_sent() for _, wire, _ in ranks]})
    assert bool(calls) == fused
    return steps


_FUSABLE = compensated.fusable
_ENCODE_COMPENSATED = compensated.encode_compensated


def _same_bits(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert np.asarray(a, np.float32).view(np.uint32).tobytes() == \
        np.asarray(b, np.float32).view(np.uint32).tobytes()


def _assert_same_steps(fused, unfused):
    for got, want in zip(fused, unfused, strict=True):
        assert got["recording"] == want["recording"]
        for key in ("results", "memory"):
            for a, b in zip(got[key], want[key], strict=True):
                _same_bits(a, b)
        for a, b in zip(got["stats"], want["stats"], strict=True):
            assert (a is None) == (b is None)
            for u, v in zip(a or (), b or ()):
                _same_bits(u, v)
        assert got["sent"] == want["sent"]
        assert got["tapped"].keys() == want["tapped"].keys()
        for r in got["tapped"]:
            for (pa, va, xa), (pb, vb, xb) in zip(sorted(got["tapped"][r], key=lambda e: e[0]),
                                                  sorted(want["tapped"][r], key=lambda e: e[0]),
                                                  strict=True):
                assert pa == pb
                _same_bits(va.numpy(), vb.numpy())
                assert xa.numpy().tobytes() == xb.numpy().tobytes()


@pytest.mark.parametrize("mode, P, coding", [
    ("allgather", 2, "fixed"), ("allgather", 3, "entropy"), ("two_phase", 3, "fixed"),
    ("two_phase", 4, "entropy"), ("two_phase", 2, "fixed")])
def test_fused_error_feedback_is_bitwise_the_unfused_steps(monkeypatch, mode, P, coding):
    # three steps (the first records refit statistics and starts the memory): the averaged
    # gradient, every rank's memory, statistics, taps and byte counts are bitwise the same
    grads = [_grads(P, seed=s, numels=BIG) for s in range(3)]
    for g in grads[1]:
        g[100:300] = 0.0                          # zero buckets
        g[5:9] = -0.0
    fused = _ef_steps(monkeypatch, True, mode, P, coding, grads)
    unfused = _ef_steps(monkeypatch, False, mode, P, coding, grads)
    assert [s["recording"] for s in fused] == [True, False, False]
    _assert_same_steps(fused, unfused)


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
@pytest.mark.parametrize("bad", [np.nan, 3e38])
def test_fused_error_feedback_markers_leave_the_senders_memory_as_it_was(monkeypatch, mode,
                                                                         bad):
    # step 1: rank 1 holds a NaN (or a bucket norm past float32) in "b"; every rank skips the
    # step, rank 1 keeps its memory of step 0, the others update theirs (docs/protocol.md §4)
    P = 3
    grads = [_grads(P, seed=s, numels=BIG) for s in range(3)]
    grads[1][1][4001:4003] = bad
    def factory():
        return horovod_aq.ErrorFeedback(horovod_aq.QSGD(
            bits=3, bucket_size=B, seed=SEED, nonfinite="skip"), alpha=1.0, beta=1.0)
    fused = _ef_steps(monkeypatch, True, mode, P, "fixed", grads, factory=factory)
    unfused = _ef_steps(monkeypatch, False, mode, P, "fixed", grads, factory=factory)
    _assert_same_steps(fused, unfused)
    assert all(np.isnan(r).all() for r in fused[1]["results"])
    _same_bits(fused[1]["memory"][1], fused[0]["memory"][1])
    assert fused[1]["tapped"].keys() == {0, 2}                # rank 1 encoded nothing
    assert not np.array_equal(fused[1]["memory"][0], fused[0]["memory"][0])


def test_fused_error_feedback_resets_a_memory_that_overflows(monkeypatch, caplog):
    # L∞ buckets of 16 holding x_0 = 3e38 + (−3e38) = 0 and x_1 = −3.4e38: g̃_0 = ±n_k/7, and
    # g_0 − g̃_0 = 3e38 + 4.9e37 overflows for the negative level: h' is reset to zero
    P = 2
    n = sum(BIG)
    g = np.zeros(n, np.float32)
    g[0::B], g[1::B] = 3e38, -3.4e38
    h = np.zeros(n, np.float32)
    h[0::B] = -3e38
    def factory():
        return horovod_aq.ErrorFeedback(horovod_aq.QSGD(
            bits=3, bucket_size=B, norm="linf", seed=SEED), alpha=1.0, beta=1.0)
    with caplog.at_level("WARNING"):
        fused = _ef_steps(monkeypatch, True, "allgather", P, "fixed", [[g, g]],
                          factory=factory, memory=[h, h])
        unfused = _ef_steps(monkeypatch, False, "allgather", P, "fixed", [[g, g]],
                            factory=factory, memory=[h, h])
    _assert_same_steps(fused, unfused)
    assert all(not m.any() for m in fused[0]["memory"])
    assert sum("became non-finite; reset to zero" in r.message for r in caplog.records) == 2 * P


def test_the_fused_pass_reuses_the_replaced_memory_as_its_output(monkeypatch):
    # double buffering: from the second step on, h' is written into the memory of two steps
    # back, and the memory of the last step is never written
    _, ranks = _ranks(2, "allgather", lambda: horovod_aq.ErrorFeedback(_qsgd()), numels=BIG)
    seen = []
    for step in range(4):
        net = Network(2)
        for comp, wire, bucket in ranks:
            comp.step, wire.comm.net = step, net
            bucket.reset()
        before = ranks[0][0].error_memory.memory.get(ranks[0][2].name)
        kept = None if before is None else before.clone()
        _run(ranks, _grads(2, seed=step, numels=BIG))
        after = ranks[0][0].error_memory.memory[ranks[0][2].name]
        if before is not None:
            assert after.data_ptr() != before.data_ptr()
            assert torch.equal(before, kept)                     # h read, never written
        seen.append(after.data_ptr())
    assert seen[2] == seen[0] and seen[3] == seen[1]
