"""The packed exchange's framework-free parts: the cost model (``cost``), the bucket plan and
collective names (``plan``), and the per-rank protocol (``protocol``: argument checks, handshake,
non-finite decision, telemetry). See docs/protocol.md §3–§8."""
