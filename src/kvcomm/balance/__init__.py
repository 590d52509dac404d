"""Load-aware slot balancing for the Redis Cluster under L3: the interface
(:mod:`.model`), policies (:mod:`.policy`), a slot-level simulator (:mod:`.sim`,
:mod:`.workloads`) and the training of the learned policy (:mod:`.train`)."""
