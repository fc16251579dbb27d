"""Tooling around the library: the ``horovod-aq`` command (:mod:`.cli`), its ``demo``
(:mod:`.demo`, whose printed lines come from :mod:`.demo_report`), paths into the repository
clone (:mod:`.repo`), the local launcher (:mod:`.launcher`), PNG plots (:mod:`.plots`), bundled
datasets (:mod:`.datasets`) and the in-process multi-worker simulation (:mod:`.simulate`)."""
