"""Tooling around the library: the ``horovod-aq`` command (:mod:`.cli`), the local launcher
(:mod:`.launcher`), PNG plots (:mod:`.plots`), bundled datasets (:mod:`.datasets`) and the
in-process multi-worker simulation (:mod:`.simulate`)."""
