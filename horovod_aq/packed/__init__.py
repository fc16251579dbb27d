"""The packed exchange's framework-free parts, one job per module (docs/protocol.md §3–§8, §15):

* ``cost``: the constant cost model (which mode a bucket is planned with); ``choice``,
  ``autowire``, ``wire_setting``: ``wire="auto"`` (the candidate wires timed on the job's own
  steps, the rule that keeps one, the schedule and agreement); ``plan``: the bucket plan and the
  name of every collective; ``protocol``: argument checks, handshake, errors, telemetry;
* the per-rank decisions every framework's exchange calls: ``send`` (the order of a bucket's
  send and its error-feedback update), ``marker`` (what replaces payloads that cannot travel),
  ``receive`` (ok / skip / raise on the rows a collective delivered), ``params`` (element →
  parameter), ``chunks`` (the real coordinates of a two-phase chunk), ``waiting`` (polls with a
  stall deadline), ``watchdog`` (the deadline of waits that cannot poll), ``world`` and
  ``trainable`` (when an exchange is planned again: elastic
  Horovod changed the world, or what trains changed; the per-step agreement on what trains).
"""
