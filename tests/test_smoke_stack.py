"""The stack works: Horovod collectives on 2 ranks, Gloo and MPI, PyTorch and TensorFlow.

One launch per (framework, controller) runs every check; each check is its own pytest test.
"""

from __future__ import annotations

import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_tf, init_torch

pytestmark = pytest.mark.multiprocess
NP = 2


# ---------------------------------------------------------------- checks run inside the ranks
def torch_allreduce():
    torch, hvd = init_torch()
    x = torch.arange(5, dtype=torch.float32) * (hvd.rank() + 1)
    return {
        "sum": hvd.allreduce(x, op=hvd.Sum, name="smoke.ar.sum").tolist(),
        "avg": hvd.allreduce(x, op=hvd.Average, name="smoke.ar.avg").tolist(),
        "size": hvd.size(),
        "rank": hvd.rank(),
    }


def torch_allgather_uint8():
    torch, hvd = init_torch()
    # Ranks send different lengths: allgather concatenates along dim 0.
    x = torch.full((hvd.rank() + 2,), 250 + hvd.rank(), dtype=torch.uint8)
    out = hvd.allgather(x, name="smoke.ag.u8")
    return {"dtype": str(out.dtype), "values": out.tolist()}


def torch_alltoall():
    torch, hvd = init_torch()
    r = hvd.rank()
    x = torch.tensor([10 * r + d for d in range(hvd.size())], dtype=torch.uint8)
    out = hvd.alltoall(x, name="smoke.a2a")
    return out.tolist()


def torch_mpi4py_ranks():
    torch, hvd = init_torch()
    from mpi4py import MPI

    return {"mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size(),
            "hvd_rank": hvd.rank(), "hvd_size": hvd.size(), "mpi_enabled": hvd.mpi_enabled()}


def tf_allreduce():
    tf, hvd = init_tf()
    x = tf.range(5, dtype=tf.float32) * float(hvd.rank() + 1)
    return {
        "sum": hvd.allreduce(x, op=hvd.Sum, name="smoke.ar.sum").numpy().tolist(),
        "avg": hvd.allreduce(x, op=hvd.Average, name="smoke.ar.avg").numpy().tolist(),
    }


def tf_allgather_uint8():
    tf, hvd = init_tf()
    x = tf.fill([hvd.rank() + 2], tf.constant(250 + hvd.rank(), dtype=tf.uint8))
    out = hvd.allgather(x, name="smoke.ag.u8")
    return {"dtype": out.dtype.name, "values": out.numpy().tolist()}


def tf_alltoall():
    tf, hvd = init_tf()
    r = hvd.rank()
    x = tf.constant([10 * r + d for d in range(hvd.size())], dtype=tf.uint8)
    return hvd.alltoall(x, name="smoke.a2a").numpy().tolist()


def tf_mpi4py_ranks():
    tf, hvd = init_tf()
    from mpi4py import MPI

    return {"mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size(),
            "hvd_rank": hvd.rank(), "hvd_size": hvd.size()}


TORCH_CHECKS = [torch_allreduce, torch_allgather_uint8, torch_alltoall]
TF_CHECKS = [tf_allreduce, tf_allgather_uint8, tf_alltoall]


#: controller -> the checks each launch runs (tests/launches.py); mpi4py shares Horovod's
#: communicator only under the MPI controller
LAUNCHES = {"torch_launch": {"gloo": TORCH_CHECKS, "mpi": TORCH_CHECKS + [torch_mpi4py_ranks]},
            "tf_launch": {"gloo": TF_CHECKS, "mpi": TF_CHECKS + [tf_mpi4py_ranks]}}


@pytest.fixture(scope="module", params=list(LAUNCHES["torch_launch"]))
def torch_launch(request):
    return run_local(LAUNCHES["torch_launch"][request.param], np=NP, controller=request.param,
                     timeout=300)


@pytest.fixture(scope="module", params=list(LAUNCHES["tf_launch"]))
def tf_launch(request):
    return run_local(LAUNCHES["tf_launch"][request.param], np=NP, controller=request.param,
                     timeout=300)


EXPECTED_SUM = [0.0, 3.0, 6.0, 9.0, 12.0]  # x·1 + x·2 for x = 0..4
EXPECTED_AVG = [0.0, 1.5, 3.0, 4.5, 6.0]
EXPECTED_GATHER = [250, 250, 251, 251, 251]
EXPECTED_A2A = [[0, 10], [1, 11]]  # rank r receives element r of every rank


def test_torch_allreduce(torch_launch):
    for rank, out in enumerate(torch_launch.get(torch_allreduce)):
        assert out["rank"] == rank and out["size"] == NP
        assert out["sum"] == EXPECTED_SUM
        assert out["avg"] == EXPECTED_AVG


def test_the_launch_times_every_check_on_every_rank(torch_launch):
    for check in TORCH_CHECKS:
        seconds = torch_launch.durations[check.__name__]
        assert len(seconds) == NP and all(0.0 <= s < 300 for s in seconds), seconds


def test_torch_allgather_uint8(torch_launch):
    for out in torch_launch.get(torch_allgather_uint8):
        assert out == {"dtype": "torch.uint8", "values": EXPECTED_GATHER}


def test_torch_alltoall(torch_launch):
    assert torch_launch.get(torch_alltoall) == EXPECTED_A2A


@pytest.mark.reads("torch_mpi4py_ranks")
def test_torch_mpi4py_sees_horovod_ranks(torch_launch):
    for out in torch_launch.get(launches.read(torch_mpi4py_ranks)):
        assert out["mpi_enabled"]
        assert (out["mpi_rank"], out["mpi_size"]) == (out["hvd_rank"], out["hvd_size"])


def test_tf_allreduce(tf_launch):
    for out in tf_launch.get(tf_allreduce):
        assert out["sum"] == EXPECTED_SUM
        assert out["avg"] == EXPECTED_AVG


def test_tf_allgather_uint8(tf_launch):
    for out in tf_launch.get(tf_allgather_uint8):
        assert out == {"dtype": "uint8", "values": EXPECTED_GATHER}


def test_tf_alltoall(tf_launch):
    assert tf_launch.get(tf_alltoall) == EXPECTED_A2A


@pytest.mark.reads("tf_mpi4py_ranks")
def test_tf_mpi4py_sees_horovod_ranks(tf_launch):
    for out in tf_launch.get(launches.read(tf_mpi4py_ranks)):
        assert (out["mpi_rank"], out["mpi_size"]) == (out["hvd_rank"], out["hvd_size"])
