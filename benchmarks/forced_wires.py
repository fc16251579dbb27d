"""The forced wires both cluster benchmarks (``cluster.py``, ``ddp_cluster.py``) time next to
the library's defaults: every exchange mode with fixed-width or entropy-coded payloads, every
other setting default. They are what ``wire="auto"`` chooses from (docs/protocol.md §5.5), so a
report shows the choice next to each alternative."""

from __future__ import annotations

#: mode name → the arguments beyond ``ALQ(bits=...)`` (packed optimizer or DDP hook state).
FORCED = {
    "allgather": {"exchange": "allgather", "wire": "fixed"},
    "two_phase": {"exchange": "two_phase", "wire": "fixed"},
    "allgather_entropy": {"exchange": "allgather", "wire": "entropy"},
    "two_phase_entropy": {"exchange": "two_phase", "wire": "entropy"},
    "node_allgather": {"exchange": "node_allgather", "wire": "fixed"},
    "node_two_phase": {"exchange": "node_two_phase", "wire": "fixed"},
}


def label(kwargs: dict) -> str:
    """A forced mode's row label: what it sets on top of the defaults."""
    return "defaults + " + ", ".join(f'{k}="{v}"' for k, v in kwargs.items())


#: mode name → its row label.
LABELS = {name: label(kwargs) for name, kwargs in FORCED.items()}
